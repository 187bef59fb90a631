"""grpo.reward_models: a reward model scoring GRPO's completions beside the reward functions, as TRL takes a model in
reward_funcs: the prompt and completion as one text (a chat prompt's conversation as the policy saw it, and the
completion, through the model's chat template; without one, the raw text joined), the model's one logit read as the
reward.

A model is a `finetune` reward run (train.objective: reward; its folder or its adapter/), any PEFT adapter of a
sequence classifier (its base loaded as AutoModelForSequenceClassification with one label, then the adapter; the
adapter folder's tokenizer, else the base's, as TRL reads the base's), or a sequence-classification checkpoint. Each
rank loads it once, in the trainer's dtype (no 4 bits: it only scores), and calls it as a reward function named after
its folder."""

from __future__ import annotations

from pathlib import Path

import torch

from finetune.data.conversations import convert_turns, template_messages
from finetune.data.template_facts import chat_template_text
from finetune.errors import RewardError
from finetune.recipe import DatasetSpec
from finetune.recipe.grpo import reward_model_folder, reward_model_name

BATCH = 8  # texts scored per forward
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json")
MESSAGES = DatasetSpec(path="reward model", format="prompt")  # messages in any chat row's shape -> the normal form


class RewardModel:
    """A sequence classifier with TRL's reward-function signature: f(prompts, completions, **columns) -> floats."""

    is_reward_model = True  # named grpo.reward_models[i] in messages, given the conversation the policy saw

    def __init__(self, path: str, *, dtype: torch.dtype, device: torch.device):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        folder, self.path = reward_model_folder(path), path
        self.__name__ = reward_model_name(path)
        try:
            tokenizer_from = str(folder)
            if (folder / "adapter_config.json").is_file():
                from peft import PeftConfig, PeftModel

                base = PeftConfig.from_pretrained(str(folder)).base_model_name_or_path
                model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1, dtype=dtype)
                model = PeftModel.from_pretrained(model, str(folder)).merge_and_unload()
                # PeftModel.save_pretrained writes no tokenizer: the base's then (TRL reads config._name_or_path's)
                tokenizer_from = tokenizer_from if _has_tokenizer(folder) else base
            else:
                model = AutoModelForSequenceClassification.from_pretrained(str(folder), dtype=dtype)
            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
        except Exception as exc:  # noqa: BLE001 (hub, file and config errors: all mean "cannot be loaded here")
            raise RewardError(f"grpo.reward_models: {path} cannot be loaded as a sequence classifier "
                              f"({type(exc).__name__}: {str(exc).splitlines()[0][:300]}). Fix: point at a finetune "
                              "reward run or a sequence-classification model whose base is on this machine.") from None
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model, self.device = model.to(device).eval(), device

    def texts(self, prompts: list, completions: list) -> list[str]:
        """What the model scores. With a chat template: a chat prompt's messages (any chat row's shape, normalized as
        the policy's prompt is) and the completion through it; a text prompt as a user turn and the completion as the
        answer, as a reward run renders its text pairs (data/templates.py). Without one, the raw text joined: a text
        prompt and its completion; a chat prompt's turns' texts joined by a blank line, then the completion (a
        system turn and a user turn become `system` blank line `user`, as a reward run on a base model joins
        data.system_prompt and a text prompt)."""
        template, out = chat_template_text(self.tokenizer), []
        for prompt, completion in zip(prompts, completions):
            # TRL's message alone (its content, the completion's text): what a chat client read beside it (final,
            # reasoning, tool_calls: rollouts.py) would render the reasoning a second time
            answer = ([{"role": "assistant", "content": m.get("content") or ""} for m in completion]
                      if isinstance(completion, list) else [{"role": "assistant", "content": completion}])
            if isinstance(prompt, list):
                messages = convert_turns(prompt + answer, MESSAGES, "a chat prompt scored by a reward model")
            elif template:
                messages = [{"role": "user", "content": prompt}, *answer]
            else:
                out.append(prompt + completion)
                continue
            if template:
                out.append(self.tokenizer.apply_chat_template(template_messages(messages, template), tokenize=False))
            else:
                turns = len(messages) - len(answer)
                out.append("\n\n".join(m["content"] for m in messages[:turns])
                           + "".join(m["content"] for m in messages[turns:]))
        return out

    @torch.no_grad()
    def __call__(self, prompts: list, completions: list, **columns) -> list[float]:
        texts, scores = self.texts(prompts, completions), []
        for start in range(0, len(texts), BATCH):
            batch = self.tokenizer(texts[start:start + BATCH], return_tensors="pt", padding=True,
                                   add_special_tokens=False).to(self.device)
            scores += self.model(**batch).logits[:, 0].float().tolist()
        return scores


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_FILES)
