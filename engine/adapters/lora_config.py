"""An adapter_config.json read the way PEFT reads it: which projections of which layers a LoRA targets, and how
much each one is scaled.

The matching rules copy PEFT 0.21's, so an adapter means here what it means under ``get_peft_model``:
``check_target_module_exists`` (list entries match a module name exactly or as a dotted suffix, a string is a
``re.fullmatch`` over the whole name, ``exclude_modules``, ``layers_to_transform``/``layers_pattern``),
``_maybe_include_all_linear_layers`` ("all-linear" is every linear layer but the output head) and
``get_pattern_key`` (``rank_pattern``/``alpha_pattern`` keys are regexes matched against a suffix of the name).
Module names are those of ``LlamaForCausalLM.named_modules()``, which Qwen2 and Mistral share.
"""

import json
import math
import re
from dataclasses import dataclass
from typing import TypeVar

from engine.config import ModelConfig
from engine.errors import AdapterFormatError, AdapterMismatchError, UnsupportedAdapterError

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PARENT = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
EMBEDDING_MODULES = ("model.embed_tokens", "lm_head")
ALL_LINEAR = "all-linear"
# PEFT's defaults for fields an adapter_config.json may leave out.
DEFAULT_R = 8
DEFAULT_LORA_ALPHA = 8
T = TypeVar("T", int, float)

# Config fields that, when set, change what the adapter computes beyond B @ A; the engine serves plain LoRA only.
UNSUPPORTED_FEATURES = {
    "use_dora": "DoRA (use_dora); merge the adapter into a plain LoRA or retrain without DoRA",
    "lora_bias": "a bias on lora_B (lora_bias); retrain with lora_bias=False",
    "use_qalora": "QA-LoRA (use_qalora), which is tied to a quantized base",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "velora_config": "VeLoRA (velora_config)",
    "kasa_config": "KaSA (kasa_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "arrow_config": "Arrow routing (arrow_config)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "layer_replication": "layer replication (layer_replication), which changes the base model's depth",
    "target_parameters": "LoRA on raw parameters (target_parameters)",
    "trainable_token_indices": "trainable token embeddings (trainable_token_indices)",
}
# Initialisations that also rewrite the base weights: the saved A and B only make sense on top of that rewrite.
BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


def projection_shapes(model: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection a LoRA may target."""
    q_width = model.num_heads * model.head_dim
    kv_width = model.num_kv_heads * model.head_dim
    hidden, intermediate = model.hidden_size, model.intermediate_size
    return {
        "q_proj": (hidden, q_width),
        "k_proj": (hidden, kv_width),
        "v_proj": (hidden, kv_width),
        "o_proj": (q_width, hidden),
        "gate_proj": (hidden, intermediate),
        "up_proj": (hidden, intermediate),
        "down_proj": (intermediate, hidden),
    }


def module_key(layer: int, module: str) -> str:
    """The name PEFT gives a projection: ``model.layers.3.self_attn.q_proj``."""
    return f"model.layers.{layer}.{PARENT[module]}.{module}"


def base_module_names(model: ModelConfig) -> list[str]:
    """Every name in ``LlamaForCausalLM.named_modules()``, the set PEFT matches target_modules against."""
    names = ["", "model", "model.embed_tokens", "model.layers"]
    for layer in range(model.num_layers):
        prefix = f"model.layers.{layer}"
        names += [prefix, f"{prefix}.self_attn", *(module_key(layer, m) for m in PROJECTIONS[:4]), f"{prefix}.mlp"]
        names += [*(module_key(layer, m) for m in PROJECTIONS[4:]), f"{prefix}.mlp.act_fn"]
        names += [f"{prefix}.input_layernorm", f"{prefix}.post_attention_layernorm"]
    return [*names, "model.norm", "model.rotary_emb", "lm_head"]


@dataclass(frozen=True, slots=True)
class LoraConfig:
    """What the engine takes from adapter_config.json: targets, ranks and scales."""

    r: int
    lora_alpha: float
    use_rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    targets: frozenset[tuple[int, str]]
    """(layer index, projection short name) pairs the config puts a LoRA on."""
    base_model_name_or_path: str | None

    def rank_of(self, key: str) -> int:
        return _pattern_value(self.rank_pattern, key, self.r)

    def scale_of(self, key: str) -> float:
        """PEFT's ``scaling``: alpha / r, or alpha / sqrt(r) with rsLoRA, after rank_pattern and alpha_pattern."""
        rank, alpha = self.rank_of(key), _pattern_value(self.alpha_pattern, key, self.lora_alpha)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def parse_lora_config(data: bytes, model: ModelConfig, source: str) -> LoraConfig:
    """Read and validate adapter_config.json's bytes; ``source`` names the adapter in error messages."""
    try:
        raw = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterFormatError(
            f"{source}: adapter_config.json is not valid JSON ({exc}); re-save the adapter with PEFT's save_pretrained"
        ) from exc
    if not isinstance(raw, dict):
        raise AdapterFormatError(f"{source}: adapter_config.json must hold a JSON object, got {type(raw).__name__}")
    _check_supported(raw, source)
    r = raw.get("r", DEFAULT_R)
    lora_alpha = raw.get("lora_alpha", DEFAULT_LORA_ALPHA)
    rank_pattern, alpha_pattern = raw.get("rank_pattern") or {}, raw.get("alpha_pattern") or {}
    if (
        not _is_positive_int(r)
        or not isinstance(rank_pattern, dict)
        or not all(_is_positive_int(v) for v in rank_pattern.values())
    ):
        raise AdapterFormatError(
            f"{source}: r and the values of rank_pattern must be positive integers, "
            f"got r={r!r}, rank_pattern={rank_pattern!r}"
        )
    if (
        not _is_number(lora_alpha)
        or not isinstance(alpha_pattern, dict)
        or not all(_is_number(v) for v in alpha_pattern.values())
    ):
        raise AdapterFormatError(
            f"{source}: lora_alpha and the values of alpha_pattern must be numbers, "
            f"got lora_alpha={lora_alpha!r}, alpha_pattern={alpha_pattern!r}"
        )
    for pattern in (*rank_pattern, *alpha_pattern):
        _compile(pattern, "a rank_pattern/alpha_pattern key", source)
    base = raw.get("base_model_name_or_path")
    return LoraConfig(
        r=r,
        lora_alpha=float(lora_alpha),
        use_rslora=bool(raw.get("use_rslora", False)),
        rank_pattern=dict(rank_pattern),
        alpha_pattern={k: float(v) for k, v in alpha_pattern.items()},
        targets=_resolve_targets(raw, model, source),
        base_model_name_or_path=base if isinstance(base, str) else None,
    )


def _check_supported(raw: dict, source: str) -> None:
    peft_type = raw.get("peft_type")
    if peft_type != "LORA":
        raise UnsupportedAdapterError(
            f"{source}: peft_type is {peft_type!r}; only LoRA adapters (peft_type 'LORA') can be served"
        )
    for field, feature in UNSUPPORTED_FEATURES.items():
        if raw.get(field):
            raise UnsupportedAdapterError(f"{source}: the adapter uses {feature}; only plain LoRA can be served")
    bias = raw.get("bias", "none")
    if bias != "none":
        raise UnsupportedAdapterError(
            f"{source}: bias={bias!r} trains the base model's biases too; only "
            "bias='none' can be served, retrain with bias='none'"
        )
    if raw.get("modules_to_save"):
        raise UnsupportedAdapterError(
            f"{source}: modules_to_save={raw['modules_to_save']!r} stores full copies of base modules, which would "
            "change the shared base model; retrain without modules_to_save"
        )
    init = raw.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(BASE_REWRITING_INITS):
        raise UnsupportedAdapterError(
            f"{source}: init_lora_weights={init!r} also rewrote the base weights, so this adapter only works on that "
            "rewritten base; save it with save_pretrained(path_initial_model_for_weight_conversion=...) to get a "
            "plain LoRA"
        )


def _resolve_targets(raw: dict, model: ModelConfig, source: str) -> frozenset[tuple[int, str]]:
    """The (layer, projection) pairs PEFT would wrap, rejecting targets this engine cannot or must not serve."""
    target = raw.get("target_modules")
    names = base_module_names(model)
    exclude, layer_indexes = raw.get("exclude_modules"), raw.get("layers_to_transform")
    if isinstance(exclude, str):
        _compile(exclude, "exclude_modules", source)
    elif exclude is not None and not (isinstance(exclude, list) and all(isinstance(e, str) for e in exclude)):
        raise AdapterFormatError(f"{source}: exclude_modules must be a regex or a list of names, got {exclude!r}")
    if layer_indexes is not None and not (
        isinstance(layer_indexes, int)
        or (isinstance(layer_indexes, list) and all(isinstance(i, int) for i in layer_indexes))
    ):
        raise AdapterFormatError(
            f"{source}: layers_to_transform must be a layer index or a list of them, got {layer_indexes!r}"
        )
    if isinstance(target, str) and target.lower() == ALL_LINEAR:
        target = [module_key(layer, m) for layer in range(model.num_layers) for m in PROJECTIONS]
    if isinstance(target, str):
        if raw.get("layers_to_transform") is not None or raw.get("layers_pattern"):
            raise AdapterFormatError(
                f"{source}: layers_to_transform/layers_pattern cannot be combined with a "
                "regex target_modules (PEFT rejects it too)"
            )
        regex = _compile(target, "target_modules", source)
        matched = [n for n in names if regex.fullmatch(n) and not _excluded(raw, n)]
        if not matched:
            raise AdapterMismatchError(
                f"{source}: target_modules regex {target!r} matches no module of this {model.model_type} model; "
                f"its LoRA targets are named like {module_key(0, 'q_proj')}"
            )
    elif isinstance(target, list | tuple) and target and all(isinstance(t, str) for t in target):
        for entry in target:
            if not any(n == entry or n.endswith(f".{entry}") for n in names):
                raise AdapterMismatchError(
                    f"{source}: target module {entry!r} does not exist on this {model.model_type} model, so the "
                    f"adapter was made for another architecture; LoRA targets here are {', '.join(PROJECTIONS)}"
                )
        matched = [n for n in names if _list_match(raw, target, n) and not _excluded(raw, n)]
    else:
        raise AdapterFormatError(
            f"{source}: target_modules must be a non-empty list of module names, "
            f"'{ALL_LINEAR}' or a regex string, got {target!r}"
        )
    return frozenset(_as_projection(n, source) for n in matched)


def _as_projection(name: str, source: str) -> tuple[int, str]:
    if name in EMBEDDING_MODULES:
        raise UnsupportedAdapterError(
            f"{source}: the adapter puts LoRA on {name}; embedding and lm_head LoRA "
            f"cannot be served, retrain targeting only {', '.join(PROJECTIONS)}"
        )
    match = re.fullmatch(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)", name)
    if match is None or match[3] not in PROJECTIONS:
        raise UnsupportedAdapterError(
            f"{source}: target_modules selects {name!r}, which is not a linear projection; "
            f"target only {', '.join(PROJECTIONS)}"
        )
    return int(match[1]), match[3]


def _list_match(raw: dict, targets: list[str], name: str) -> bool:
    """PEFT's list matching, then its layers_to_transform filter."""
    if name in targets:
        return True
    if not any(name.endswith(f".{t}") for t in targets):
        return False
    layer_indexes = raw.get("layers_to_transform")
    if layer_indexes is None or layer_indexes == []:
        return True
    layers_pattern = raw.get("layers_pattern")
    match = None
    if not layers_pattern:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", name)
    else:
        for pattern in [layers_pattern] if isinstance(layers_pattern, str) else layers_pattern:
            match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", name)
            if match is not None:
                break
    if match is None:
        return False
    index = int(match["idx"])
    return index == layer_indexes if isinstance(layer_indexes, int) else index in layer_indexes


def _excluded(raw: dict, name: str) -> bool:
    exclude = raw.get("exclude_modules")
    if not exclude:
        return False
    if isinstance(exclude, str):
        return re.fullmatch(exclude, name) is not None
    return name in exclude or any(name.endswith(f".{e}") for e in exclude)


def _pattern_value(patterns: dict[str, T], key: str, default: T) -> T:
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def _compile(pattern: str, what: str, source: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise AdapterFormatError(f"{source}: {what} {pattern!r} is not a valid regular expression ({exc})") from exc


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
