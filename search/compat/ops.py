"""The reference's flat op list (SPEC §2) and how our sub-layer units map onto it.

GPT: ``[embedding] + L x 13 layer ops + [final-layernorm, post-process]``. A layer's ops 0-7 are our attention
unit, ops 8-12 our MLP unit. T5: ``[embedding] + L x 13 encoder ops + [enc-final-layernorm, decoder-embedding]
+ Ld x 21 decoder ops + [dec-final-layernorm, post-process]``; an encoder layer splits like GPT, a decoder layer
into self-attention (ops 0-7), cross-attention (8-15) and MLP (16-20).

The ops that belong to no unit ("glue") go with a neighbour: the embedding with the first stage, the final
layernorm and post-process with the last; for T5 the encoder's final layernorm closes the encoder (it stays with
the stage of the last encoder unit) and the decoder embedding opens the decoder (with the stage of the first
decoder unit) — as in megatron-core's T5 and in the reference's own Megatron-style configs.

Recompute of a unit as op flags: ``selective`` = the attention core (score, softmax, dropout, context: unit ops
2-5) of an attention unit; GEMM-1 and the gelu (unit ops 1-2) of an MLP unit; ``full`` = every op of the unit;
``attn_dropout`` (attention units only) = the dropout and the context product (unit ops 4-5): the reference's memory
rule then frees the dropout op's activations (its mask and output), exactly what the runtime's choice frees. It is
the reference search's most frequent attention pattern after the whole core (10 of 24 units in its GPT-1.3B plan).
MLP ``selective`` means activation recompute (the runtime recomputes the activation function and frees its
output). The reference's memory model keeps the last op of a recompute segment, so a lone gelu flag frees
nothing; [GEMM-1, gelu] is the smallest op segment that frees an activation of the same size (the 4h GEMM-1
output), at the price of also recomputing GEMM-1's forward: pessimistic on time, equal on memory. It is also the
MLP pattern the reference's own search picks.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..costmodel.types import ATTN_DROPOUT, N_RC
from search.io.errors import AcesoError

GPT_LAYER_OPS = 13
T5_ENC_LAYER_OPS = 13
T5_DEC_LAYER_OPS = 21
# unit kind -> (number of ops, op offsets flagged by selective recompute, by attn_dropout (None: not allowed))
UNIT_OPS = {"attention": (8, (2, 3, 4, 5), (4, 5)), "cross_attention": (8, (2, 3, 4, 5), (4, 5)),
            "mlp": (5, (1, 2), None)}
SEGMENT_START = "enc-1st-layernorm"   # where the reference splits recompute segments (not dec-1st-layernorm)
_ENC = ("enc-1st-layernorm", "enc-attention-qkv", "enc-attention-score", "enc-attention-softmax",
        "enc-attention-dropout", "enc-attention-context", "enc-attention-dense", "enc-post-attention-dropout",
        "enc-2nd-layernorm", "enc-MLP-GEMM-1", "enc-MLP-gelu", "enc-MLP-GEMM-2", "enc-post-MLP-dropout")
_DEC = tuple(f"dec-{n}-{i}" for i in (1, 2) for n in (
    "attention-qkv", "attention-score", "attention-softmax", "attention-dropout", "attention-context",
    "attention-dense", "post-attention-dropout"))
_DEC = (("dec-1st-layernorm",) + _DEC[:7] + ("dec-2nd-layernorm",) + _DEC[7:]
        + ("dec-3rd-layernorm", "dec-MLP-GEMM-1", "dec-MLP-gelu", "dec-MLP-GEMM-2", "dec-post-MLP-dropout"))
# The database's per-layer op templates (the op CSVs' column 0, SPEC §1.7)
TEMPLATES = {
    "gpt": ("encoder-embedding",) + _ENC + ("final-layernorm", "gpt-post-process"),
    "t5": ("encoder-embedding",) + _ENC + ("enc-final-layernorm", "decoder-embedding") + _DEC
          + ("dec-final-layernorm", "t5-post-process"),
}


@dataclass(frozen=True)
class OpLayout:
    """The op list of one model depth, with each unit's op span."""

    family: str                       # gpt | t5
    names: tuple[str, ...]
    unit_kinds: tuple[str, ...]       # per unit: attention | cross_attention | mlp
    unit_start: tuple[int, ...]       # per unit: its first op
    bounds: tuple[int, ...]           # (U+1,) first op of a stage that starts at unit u; bounds[U] = len(names)

    @property
    def num_ops(self) -> int:
        return len(self.names)

    @property
    def num_units(self) -> int:
        return len(self.unit_kinds)

    def unit_ops(self, u: int) -> range:
        return range(self.unit_start[u], self.unit_start[u] + UNIT_OPS[self.unit_kinds[u]][0])

    def stage_ops(self, start_unit: int, end_unit: int) -> range:
        return range(self.bounds[start_unit], self.bounds[end_unit])

    @cached_property
    def op_unit(self) -> np.ndarray:
        """(num_ops,) the unit of each op, -1 for glue ops."""
        out = np.full(self.num_ops, -1, dtype=np.int64)
        for u in range(self.num_units):
            r = self.unit_ops(u)
            out[r.start:r.stop] = u
        out.setflags(write=False)
        return out

    @cached_property
    def flag_patterns(self) -> np.ndarray:
        """(N_RC, num_ops) int8: the op recompute flags if every unit took choice c (glue ops never recomputed; an
        MLP unit's attn_dropout row is empty: the search never gives it that choice)."""
        pat = np.zeros((N_RC, self.num_ops), dtype=np.int8)
        for u in range(self.num_units):
            n, sel, drop = UNIT_OPS[self.unit_kinds[u]]
            s = self.unit_start[u]
            pat[1, [s + k for k in sel]] = 1
            pat[2, s:s + n] = 1
            if drop:
                pat[ATTN_DROPOUT, [s + k for k in drop]] = 1
        pat.setflags(write=False)
        return pat

    @cached_property
    def segment_start(self) -> np.ndarray:
        out = np.array([n == SEGMENT_START for n in self.names], dtype=bool)
        out.setflags(write=False)
        return out

    def op_flags(self, start_unit: int, end_unit: int, recompute) -> np.ndarray:
        """Op flags (int8) of the stage's ops for per-unit recompute codes (``RC_CODE``)."""
        ops = self.stage_ops(start_unit, end_unit)
        units = self.op_unit[ops.start:ops.stop]
        codes = np.zeros(len(units), dtype=np.int64)
        inside = units >= 0
        codes[inside] = np.asarray(recompute, dtype=np.int64)[units[inside] - start_unit]
        return self.flag_patterns[codes, np.arange(ops.start, ops.stop)]

    def unit_choice(self, flags) -> list[int]:
        """Per unit, the smallest recompute choice whose op pattern covers the unit's flags (full op list)."""
        flags = np.asarray(flags, dtype=bool)
        out = []
        for u in range(self.num_units):
            r = self.unit_ops(u)
            f = flags[r.start:r.stop]
            for c in (0, ATTN_DROPOUT, 1, 2):   # by the ops they recompute: none < attn_dropout < selective < full
                pat = self.flag_patterns[c, r.start:r.stop].astype(bool)
                if (c == 0 or pat.any()) and not (f & ~pat).any():
                    out.append(c)
                    break
        return out



def build_layout(template: tuple[str, ...], family: str, num_layers: int, num_decoder_layers: int = 0) -> OpLayout:
    """Expand the database's per-layer template (SPEC §1.7, §2) to the full op list."""
    if family == "t5":
        want = 1 + T5_ENC_LAYER_OPS + 2 + T5_DEC_LAYER_OPS + 2
        if len(template) != want:
            raise AcesoError(f"the T5 op template has {len(template)} ops, expected {want}; the database is not a "
                             "T5 database")
        enc = template[1:1 + T5_ENC_LAYER_OPS]
        mid = template[1 + T5_ENC_LAYER_OPS:3 + T5_ENC_LAYER_OPS]
        dec = template[3 + T5_ENC_LAYER_OPS:3 + T5_ENC_LAYER_OPS + T5_DEC_LAYER_OPS]
        names = (template[:1] + enc * num_layers + mid + dec * num_decoder_layers + template[-2:])
        kinds, starts = [], []
        for layer in range(num_layers):
            base = 1 + T5_ENC_LAYER_OPS * layer
            kinds += ["attention", "mlp"]
            starts += [base, base + 8]
        for layer in range(num_decoder_layers):
            base = 3 + T5_ENC_LAYER_OPS * num_layers + T5_DEC_LAYER_OPS * layer
            kinds += ["attention", "cross_attention", "mlp"]
            starts += [base, base + 8, base + 16]
        first_dec = 2 * num_layers
    else:
        want = 1 + GPT_LAYER_OPS + 2
        if len(template) != want:
            raise AcesoError(f"the GPT op template has {len(template)} ops, expected {want}; the database is not a "
                             "GPT database")
        names = template[:1] + template[1:1 + GPT_LAYER_OPS] * num_layers + template[-2:]
        kinds = ["attention", "mlp"] * num_layers
        starts = [1 + GPT_LAYER_OPS * (u // 2) + 8 * (u % 2) for u in range(2 * num_layers)]
        first_dec = -1
    bounds = [0] + starts[1:] + [len(names)]
    if first_dec > 0:
        bounds[first_dec] -= 1  # the decoder embedding opens the decoder's first stage
    return OpLayout(family=family, names=tuple(names), unit_kinds=tuple(kinds), unit_start=tuple(starts),
                    bounds=tuple(bounds))


def layout_for_model(model) -> OpLayout:
    """The op layout of a ``ModelSpec`` (GPT or T5; Llama has no reference op model)."""
    if model.family not in TEMPLATES:
        raise AcesoError(f"model {model.name}: family {model.family} has no Aceso op model; aceso-compat covers "
                         "gpt and t5")
    return build_layout(TEMPLATES[model.family], model.family, model.num_layers, model.num_decoder_layers or 0)
