"""Parallel: choose and check the strategy before any weight loads, wrap the model, and run its steps through the wrap.

Strategies: single process, DDP, FSDP (2 or 1) with the transformer auto-wrap policy, DeepSpeed ZeRO-2/3, layer split.

    plan.py        resolve_plan (strategy + pre-flight checks), report     launcher.py  the accelerate config's settings
    decision.py    ParallelPlan: what was decided                          byte_guard.py  4-bit bytes under FSDP2
    checks.py      the recipe / accelerate config / FSDP + 4-bit rules     layers.py    decoder layer class, layer split
    wrapping.py    wrap (FSDP2, FSDP1, DDP, ZeRO), unwrap                  zero.py      the DeepSpeed ZeRO-2/3 engine
    engines/       what each strategy's wrapper does at run time (engine_of(model): the one place that asks)
    steps.py       gradient_sync, backward, optimizer_step, generation_model (through the model's engine)
    generation.py  decoding_model: GRPO's sampling model per strategy (FSDP2 unsharded once per generate call)
    state_dict.py  trainable_state_dict, normalize_key, local_parameter_bytes
    zero_json.py   a user's DeepSpeed JSON read and checked (shapes, unknown sections, "auto" values)
    config_keys.py the "did you mean" and "found ..." wording of config-key refusals
"""

from finetune.parallel.decision import ParallelPlan
from finetune.parallel.generation import decoding_model
from finetune.parallel.launcher import accelerate_config_env, launcher_settings
from finetune.parallel.layers import decoder_layer_class, decoder_layers_path, layer_split_device_map, meta_model
from finetune.parallel.plan import report, resolve_plan
from finetune.parallel.state_dict import local_parameter_bytes, normalize_key, trainable_state_dict
from finetune.parallel.steps import backward, engine_optimizer, generation_model, gradient_sync, optimizer_step, reshard
from finetune.parallel.wrapping import unwrap, wrap

__all__ = [
    "ParallelPlan", "accelerate_config_env", "backward", "decoder_layer_class", "decoder_layers_path", "decoding_model",
    "engine_optimizer", "generation_model", "gradient_sync", "launcher_settings", "layer_split_device_map",
    "local_parameter_bytes", "meta_model", "normalize_key", "optimizer_step", "report", "reshard", "resolve_plan",
    "trainable_state_dict", "unwrap", "wrap",
]
