"""The expert shapes a stage of an MoE model may take (MoE parallel folding), for the search and the baseline.

A stage of ``tp x cp x dp`` GPUs folds its experts as ``etp x ep x edp`` over the same GPUs (``search/settings/moe_plan.py``
has megatron-core 0.16.1's rules; this module enumerates what they allow). Candidates, kept few on purpose:

* ``etp`` in {1, tp}: megatron-core's default is the attention tp (``expert_tensor_parallel_size`` unset), the
  published runs use 1; ``etp`` must divide the expert widths, and linear biases allow only 1;
* ``ep``: every divisor of ``num_experts`` that divides ``num_gpus / etp``;
* the user's limits (``--ep``, ``--max-ep``, ``--etp``: ``constraints.expert_limits``) keep only those degrees;
* a cost model that prices only measured expert shapes (the profile model: ``ProfileSource.expert_shapes``, the
  (tp, ep, etp) of the database's moe rows under the plan's dispatcher, docs/profile-db.md) restricts both to those
  (``measured``), so the search never proposes a shape the cost model refuses.

A ``Shape`` stores ``etp`` 0 for "the stage's tp" (as ``StageSpec.etp`` None), so each (ep, etp) has one code: 0
when it equals tp (always at tp 1), else 1. ``fit`` gives a new attention shape its expert shape: the old one's
where still legal (``ep`` the largest legal at most the old one), else the default: etp 1 and the largest ep (the
least expert memory and gradient traffic; the moves lower it where the all-to-all costs more).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..costmodel.types import Shape


@dataclass(frozen=True)
class ExpertSpace:
    """An MoE model's expert-shape constraints (``of(model)``; None for a dense model)."""

    num_experts: int
    widths: tuple[int, ...]     # moe_ffn_hidden_size and the shared expert's width: etp must divide them
    etp_tp: bool = True         # False with linear biases (megatron-core: MoE biases only with etp 1)
    measured: frozenset[tuple[int, int, int]] | None = None   # (tp, ep, etp degree) the cost model prices; None: all
    allowed_eps: frozenset[int] | None = None     # --ep (None: any)
    max_ep: int | None = None                     # --max-ep (None: no bound)
    allowed_etps: frozenset[int] | None = None    # --etp degrees (None: 1 and tp)

    @classmethod
    def of(cls, model, measured=None, dispatcher: str = "alltoall", eps=None, max_ep=None,
           etps=None) -> "ExpertSpace | None":
        """``measured``: the (tp, ep, etp degree, dispatcher) the cost model prices (None: every shape); only those
        of ``dispatcher`` (the plan's, under which the search runs) are kept. ``eps`` / ``max_ep`` / ``etps``: the
        user's limits (``constraints.expert_limits``: --ep, --max-ep, --etp)."""
        moe = model.moe
        if moe is None:
            return None
        widths = (moe.moe_ffn_hidden_size,) + ((moe.moe_shared_expert_intermediate_size,)
                                               if moe.moe_shared_expert_intermediate_size else ())
        keep = None if measured is None else frozenset((t, e, x) for t, e, x, d in measured if d == dispatcher)
        return cls(moe.num_experts, widths, not model.add_bias_linear, keep, eps, max_ep, etps)

    def etps(self, tp: int) -> tuple[int, ...]:
        """The etp codes a stage of this tp may take (0 = tp, 1 = etp 1 under tp > 1), megatron-core's default
        first; with ``measured``, only codes some measured shape at this tp has; with ``allowed_etps``, only codes
        of those degrees."""
        out = [0] if tp == 1 or (self.etp_tp and all(w % tp == 0 for w in self.widths)) else []
        out += [1] if tp > 1 else []
        if self.measured is not None:
            out = [c for c in out if any(t == tp and x == (c or tp) for t, _, x in self.measured)]
        if self.allowed_etps is not None:
            out = [c for c in out if (c or tp) in self.allowed_etps]
        return tuple(out)

    def eps(self, num_gpus: int, etp: int, tp: int) -> tuple[int, ...]:
        """Every ep of ``num_gpus`` GPUs at expert tp ``etp`` (a degree, not a code) under attention tp ``tp``,
        ascending (with ``measured``: the measured ones; within --ep / --max-ep)."""
        out = _common_divisors(num_gpus // etp if num_gpus % etp == 0 else 0, self.num_experts)
        if self.measured is not None:
            out = tuple(e for e in out if (tp, e, etp) in self.measured)
        if self.allowed_eps is not None or self.max_ep is not None:
            out = tuple(e for e in out if (self.allowed_eps is None or e in self.allowed_eps)
                        and (self.max_ep is None or e <= self.max_ep))
        return out

    def options(self, s: Shape) -> list[tuple[int, int]]:
        """Every (ep, etp code) of stage shape ``s``."""
        return [(e, code) for code in self.etps(s.tp) for e in self.eps(s.num_gpus, code or s.tp, s.tp)]

    def ok(self, s: Shape) -> bool:
        return s.etp in self.etps(s.tp) and s.ep in self.eps(s.num_gpus, s.etp or s.tp, s.tp)

    def fit(self, s: Shape, old: Shape | None = None) -> Shape | None:
        """``s`` with an expert shape: ``old``'s etp code and at most its ep where legal, else the default (etp 1,
        the largest ep); None when the stage has none."""
        codes = self.etps(s.tp)
        if not codes:
            return None
        pref = [c for c in ((old.etp if old is not None else None), 1, 0) if c in codes]
        code = next((c for c in pref if self.eps(s.num_gpus, c or s.tp, s.tp)), None)
        if code is None:
            return None
        eps = self.eps(s.num_gpus, code or s.tp, s.tp)
        top = old.ep if old is not None else eps[-1]
        ep = max((e for e in eps if e <= top), default=eps[0])
        return s._replace(ep=ep, etp=code)

    def stepped(self, s: Shape, step: int) -> Shape | None:
        """``s`` at the next larger (``step`` 1) or smaller (-1) ep of the same etp; None at the end."""
        eps = self.eps(s.num_gpus, s.expert_tp, s.tp)
        k = eps.index(s.ep) + step if s.ep in eps else -1
        return s._replace(ep=eps[k]) if 0 <= k < len(eps) else None

    def toggled(self, s: Shape) -> Shape | None:
        """``s`` with the other etp (1 <-> tp), ep kept where legal else the nearest smaller; None if none."""
        other = [c for c in self.etps(s.tp) if c != s.etp]
        if not other:
            return None
        eps = self.eps(s.num_gpus, other[0] or s.tp, s.tp)
        ep = max((e for e in eps if e <= s.ep), default=None)
        return None if ep is None else s._replace(ep=ep, etp=other[0])


@functools.lru_cache(maxsize=4096)
def _common_divisors(a: int, b: int) -> tuple[int, ...]:
    """Every common divisor of ``a`` and ``b``, ascending (none when ``a`` is 0)."""
    return tuple(e for e in range(1, a + 1) if a % e == 0 and b % e == 0)
