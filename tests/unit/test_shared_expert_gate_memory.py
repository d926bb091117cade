"""The shared expert's sigmoid gate is priced whole on every TP rank, as megatron-core allocates it. Reference:
megatron-core (0.16.1 to 0.19.2) ``SharedExpertMLP.__init__``: ``self.gate_weight = torch.nn.Parameter(torch.empty((1,
config.hidden_size)))``, a plain parameter outside the column / row-parallel linears (not split over tp; marked
``sequence_parallel`` so its gradient is all-reduced over TP like the norms'). The shared expert's own MLP
(``linear_fc1`` column-, ``linear_fc2`` row-parallel) is split over tp. Before, the gate was divided by tp too."""

from __future__ import annotations

import pytest

from search.costmodel.moe_cost import moe_params_per_rank
from search.layers.moe_spec import MoESpec
from tests.tiny_models import LLAMA

H, E, FE, FS = 32, 4, 16, 64            # tiny LLAMA: hidden 32, RMSNorm, SwiGLU, no linear biases
GATED = LLAMA.model_copy(update={"moe": MoESpec(num_experts=E, moe_router_topk=2, moe_ffn_hidden_size=FE,
                                                moe_shared_expert_intermediate_size=FS,
                                                moe_shared_expert_gate=True)})


def _by_hand(t: int, ep: int, etp: int, gate: bool) -> tuple[float, float]:
    norm, router = H, E * H                               # RMSNorm weight; router weight E x h, whole
    shared = (H * 2 * FS + FS * H) / t                    # SwiGLU fc1 (h -> 2 fs) and fc2 (fs -> h), split over tp
    expert = E // ep * (H * 2 * FE + FE * H) / etp
    return norm + router + shared + (H if gate else 0) + expert, expert


@pytest.mark.parametrize("t, ep, etp", [(1, 1, 1), (2, 1, 2), (4, 2, 1), (8, 4, 2)])
def test_the_gate_is_whole_on_every_tp_rank(t, ep, etp):
    assert moe_params_per_rank(GATED, t, ep, etp) == pytest.approx(_by_hand(t, ep, etp, gate=True), rel=1e-12)
    plain = GATED.model_copy(update={"moe": GATED.moe.model_copy(update={"moe_shared_expert_gate": False})})
    assert moe_params_per_rank(plain, t, ep, etp) == pytest.approx(_by_hand(t, ep, etp, gate=False), rel=1e-12)
