"""grpo.reward_models: a reward model scoring GRPO's completions beside the reward functions, as TRL takes a model in
reward_funcs: the prompt and completion as one text (a chat prompt's messages and the completion through the chat
template), the model's one logit read as the reward.

A model is a `finetune` reward run (train.objective: reward; its folder or its adapter/), any PEFT adapter of a
sequence classifier (its base loaded as AutoModelForSequenceClassification with one label, then the adapter), or a
sequence-classification checkpoint. Each rank loads it once, in the trainer's dtype (no 4 bits: it only scores), and
calls it as a reward function named after its folder."""

from __future__ import annotations

import torch

from finetune.errors import RewardError
from finetune.recipe.grpo import reward_model_folder

BATCH = 8  # texts scored per forward


class RewardModel:
    """A sequence classifier with TRL's reward-function signature: f(prompts, completions, **columns) -> floats."""

    def __init__(self, path: str, *, dtype: torch.dtype, device: torch.device):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        folder = reward_model_folder(path)
        self.__name__ = (folder.parent.name if folder.name == "adapter" else folder.name) or "reward_model"
        try:
            if (folder / "adapter_config.json").is_file():
                from peft import PeftConfig, PeftModel

                base = PeftConfig.from_pretrained(str(folder)).base_model_name_or_path
                model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1, dtype=dtype)
                model = PeftModel.from_pretrained(model, str(folder)).merge_and_unload()
            else:
                model = AutoModelForSequenceClassification.from_pretrained(str(folder), dtype=dtype)
            self.tokenizer = AutoTokenizer.from_pretrained(str(folder))
        except Exception as exc:  # noqa: BLE001 (hub, file and config errors: all mean "cannot be loaded here")
            raise RewardError(f"grpo.reward_models: {path} cannot be loaded as a sequence classifier "
                              f"({type(exc).__name__}: {str(exc).splitlines()[0][:300]}). Fix: point at a finetune "
                              "reward run or a sequence-classification model whose base is on this machine.") from None
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model, self.device = model.to(device).eval(), device

    def texts(self, prompts: list, completions: list) -> list[str]:
        """What the model scores: the prompt and completion through its chat template when it has one (a text prompt
        as a user turn, as a reward run renders its text pairs: data/templates.py), else the raw text joined."""
        out = []
        for prompt, completion in zip(prompts, completions):
            if isinstance(prompt, list):  # chat: the messages and the completion's, through the template
                out.append(self.tokenizer.apply_chat_template(prompt + completion, tokenize=False))
            elif getattr(self.tokenizer, "chat_template", None):
                out.append(self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}], tokenize=False))
            else:
                out.append(prompt + completion)
        return out

    @torch.no_grad()
    def __call__(self, prompts: list, completions: list, **columns) -> list[float]:
        texts, scores = self.texts(prompts, completions), []
        for start in range(0, len(texts), BATCH):
            batch = self.tokenizer(texts[start:start + BATCH], return_tensors="pt", padding=True,
                                   add_special_tokens=False).to(self.device)
            scores += self.model(**batch).logits[:, 0].float().tolist()
        return scores
