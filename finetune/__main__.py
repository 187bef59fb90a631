from finetune.cli import entry

entry()
