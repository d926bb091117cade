"""The entry point of a launch script: aceso prices what ``pretrain_gpt.py`` and ``pretrain_t5.py`` (core_v0.16.1)
run; any other Megatron-LM program is refused with what it is, in one line.

``script_names`` finds the ``.py`` files a script names anywhere (also inside a loop or an ``if`` it cannot read),
so a script is refused for what it runs before it is refused for how it is written.
"""

from __future__ import annotations

import re

from ..errors import AcesoError

PRICED = ("pretrain_gpt.py", "pretrain_t5.py")

# (pattern on the script's path, what it is)
_KINDS = (
    (r"pretrain_bert\.py$", "BERT pretraining (pretrain_bert.py), which aceso does not price"),
    (r"pretrain_(mamba|hybrid)\.py$", "a hybrid Mamba model, which aceso does not price"),
    (r"pretrain_(vlm|ict|retro|vision\w*|mimo)\.py$|multimodal/train\.py$|mimo/train\.py$",
     "a multimodal / vision-language model, which aceso does not price"),
    (r"text_generation|inference|generate\w*\.py$|_cli\.py$",
     "inference / text generation, not training; aceso plans training runs"),
    (r"preprocess\w*\.py$|data_processing", "data preprocessing, not training"),
    (r"post_training|modelopt|(convert\w*|export|quantize|prune|mmlu|validate|offline_feature_extract|"
     r"checkpoint_converter|combine_state_dicts)\.py$",
     "a checkpoint / post-training (ModelOpt) tool, not pretraining; aceso plans pretrain_gpt.py and "
     "pretrain_t5.py runs"),
    (r"finetune\w*\.py$|tasks/.*main\.py$", "a fine-tuning or task script whose model and data path aceso cannot "
                                             "read; price its run as pretrain_gpt.py arguments"),
)


def what_it_runs(script: str) -> str:
    for pattern, what in _KINDS:
        if re.search(pattern, script):
            return what
    return "not a Megatron-LM pretraining entry point aceso prices (pretrain_gpt.py, pretrain_t5.py)"


def refuse_entry(script: str, source: str):
    raise AcesoError(f"{source}: runs {script}: {what_it_runs(script)}")


def script_names(text: str) -> list[str]:
    """Every ``*.py`` path the text names (comments excluded), in order."""
    out = []
    for line in text.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line)
        out += re.findall(r"[\w./${}-]*\.py\b", line)
        out += [m + ".py" for m in re.findall(r"python3?\s+-u?m\s+([\w.${}]+)", line)]   # python -m a.b
    return out


def check_unreadable(text: str, source: str, err: AcesoError):
    """A script aceso cannot read: refuse it for what it runs when that is not a priced entry point."""
    names = script_names(text)
    if names and not any(n.rsplit("/", 1)[-1] in PRICED for n in names):
        refuse_entry(names[-1], source)
    raise err
