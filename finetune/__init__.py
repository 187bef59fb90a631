"""finetune: QLoRA fine-tuning sharded by FSDP. A YAML recipe in, a standard PEFT adapter out."""

__version__ = "0.1.0"
