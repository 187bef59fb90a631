"""Library noise a user can do nothing about, kept out of a run's output unless asked (--verbose, FINETUNE_VERBOSE=1).

What is filtered, each by its exact message, so that a new warning of the same libraries still shows:
  * bitsandbytes' "Failed to load CPU gemm_4bit_forward from kernels-community" (an optional CPU kernel package; the
    built-in kernel is used instead), logged once per process at import;
  * transformers' FutureWarning "`is_gradient_checkpointing` is deprecated", raised by PEFT's own attribute check;
  * DeepSpeed's "Setting accelerator to CPU" (said by every process of a CPU DeepSpeed run);
  * the progress bars of transformers' weight loading and saving (finetune prints its own model line).
And DeepSpeed stays out of processes that do not use it (`keep_deepspeed_out`).
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

VERBOSE_ENV = "FINETUNE_VERBOSE"
_LOGGED = {
    "bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward from kernels-community",
    "DeepSpeed": "Setting accelerator to CPU",
}


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "").strip().lower() in ("1", "true", "yes")


class _DropMessage(logging.Filter):
    def __init__(self, start: str):
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(self.start)


def install() -> None:
    """Filter the noise above in this process (and, through the environment, in the processes it launches)."""
    if verbose():
        return
    warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    for name, start in _LOGGED.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) for f in logger.filters):
            logger.addFilter(_DropMessage(start))
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read by huggingface_hub and transformers at import
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()


def keep_deepspeed_out() -> None:
    """A process that does not use DeepSpeed never imports it (150-200 MB of RSS and seconds of start-up).

    accelerate's `extract_model_from_parallel`, which transformers' `save_pretrained` calls on every save, imports
    `deepspeed` whenever it is installed, only to check `isinstance(model, DeepSpeedEngine)`. No model of such a
    process is a DeepSpeed engine, so that module's availability check is answered "no" for this process only.
    """
    if "deepspeed" in sys.modules:
        return
    try:
        import accelerate.utils.other as accelerate_other
    except ImportError:
        return
    accelerate_other.is_deepspeed_available = lambda: False
