"""Tiny random DeepSeek-V2/V3, GLM-4.7-Flash (MLA) and GLM-4.5 models, for tests."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from tests.model_helpers import make_tiny_tokenizer, random_eager_model

_COMMON = dict(
    vocab_size=320,
    num_hidden_layers=3,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.1,  # peaky logits and router scores: greedy and top-k ties unlikely
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
    hidden_size=96,
    intermediate_size=72,
    moe_intermediate_size=40,
    n_routed_experts=8,
    n_shared_experts=1,
)
_MLA = dict(
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
)
_YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=128,
    mscale=1.0,
    mscale_all_dim=1.0,
    beta_fast=32,
    beta_slow=1,
)

# model_type -> (HF config class, overrides)
DEEPSEEK_CONFIGS: dict[str, tuple[str, dict]] = {
    # no q low rank, softmax scores, V2's group limit (best expert per group), no renormalising
    "deepseek_v2": (
        "DeepseekV2Config",
        dict(_COMMON, **_MLA, q_lora_rank=None, num_experts_per_tok=3, first_k_dense_replace=1,
             topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5),
    ),
    # q low rank, sigmoid scores with the choice bias, 4 groups with 2 kept, a dense first
    # layer, YaRN with mscale_all_dim
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(_COMMON, **_MLA, q_lora_rank=48, num_experts_per_tok=3, first_k_dense_replace=1,
             n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
             rope_parameters=_YARN),
    ),
    # v_head_dim differs from qk_nope_head_dim; dense layers from mlp_layer_types
    "glm4_moe_lite": (
        "Glm4MoeLiteConfig",
        dict(_COMMON, **dict(_MLA, v_head_dim=20), q_lora_rank=48, num_experts_per_tok=2,
             mlp_layer_types=["dense", "sparse", "sparse"], routed_scaling_factor=1.8),
    ),
    # GQA, half the head rotated, q/k/v bias, q/k norm, V3's router
    "glm4_moe": (
        "Glm4MoeConfig",
        dict(_COMMON, head_dim=24, num_attention_heads=4, num_key_value_heads=2,
             num_experts_per_tok=2, first_k_dense_replace=1, n_group=2, topk_group=1,
             attention_bias=True, use_qk_norm=True, routed_scaling_factor=2.0,
             partial_rotary_factor=0.5),
    ),
}  # fmt: skip
DEEPSEEK_ARCHITECTURES: tuple[str, ...] = tuple(DEEPSEEK_CONFIGS)


def tiny_deepseek_config(arch: str, **overrides) -> transformers.PretrainedConfig:
    class_name, kwargs = DEEPSEEK_CONFIGS[arch]
    return getattr(transformers, class_name)(**{**kwargs, **overrides})


def build_tiny_deepseek_model(
    arch: str, seed: int = 0, **overrides
) -> transformers.PreTrainedModel:
    """A random fp32 HF model of `arch` (eager attention); norms, biases and the routers'
    choice biases perturbed so that loading them matters."""
    torch.manual_seed(seed)
    model = random_eager_model(tiny_deepseek_config(arch, **overrides))
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.05 * torch.randn_like(buffer))
    return model


def make_tiny_deepseek_model(arch: str, path: str | Path, seed: int = 0, **overrides) -> Path:
    """Save a tiny random `arch` model (config, safetensors, tokenizer) under `path`."""
    path = Path(path)
    model = build_tiny_deepseek_model(arch, seed, **overrides)
    model.save_pretrained(path)
    make_tiny_tokenizer(model.config.vocab_size).save_pretrained(path)
    return path


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def make_tiny_mtp_model(arch: str, path: str | Path, seed: int = 0, own_head: bool = True):
    """A tiny `arch` checkpoint that carries an MTP layer (`model.layers.{N}.*`, with
    `num_nextn_predict_layers: 1`) under `path`; returns (path, reference) where
    `reference(tokens, drafts)` gives the logits of the MTP's drafts after `tokens` (the first
    from the row at len - 2: the target's final hidden state there and the last token), computed with
    transformers' decoder layer: a one-layer HF model holding the MTP's layer, fed
    eh_proj([enorm(embed(t[p+1])); hnorm(h_p)]) as input embeddings, its final norm the
    MTP's shared_head.norm and its LM head shared_head.head. See `reference` for chained
    drafts."""
    path = Path(path)
    main_config = tiny_deepseek_config(arch)
    n = main_config.num_hidden_layers
    extra = {}
    if getattr(main_config, "mlp_layer_types", None) is not None:
        extra["mlp_layer_types"] = [*main_config.mlp_layer_types, "sparse"]
    big = build_tiny_deepseek_model(arch, seed, num_hidden_layers=n + 1, **extra)
    state = big.state_dict()
    layer_prefix = f"model.layers.{n}."
    main = random_eager_model(main_config)
    main.load_state_dict({k: v for k, v in state.items() if not k.startswith(layer_prefix)})
    main.config.num_nextn_predict_layers = 1
    main.save_pretrained(path)
    make_tiny_tokenizer(main_config.vocab_size).save_pretrained(path)

    g = torch.Generator().manual_seed(seed + 1)
    hidden, vocab, eps = main_config.hidden_size, main_config.vocab_size, main_config.rms_norm_eps
    mtp = {k: v.clone() for k, v in state.items() if k.startswith(layer_prefix)}
    extras = {
        "enorm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
        "hnorm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
        "eh_proj.weight": 0.1 * torch.randn(hidden, 2 * hidden, generator=g),
        "shared_head.norm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
        "shared_head.head.weight": 0.1 * torch.randn(vocab, hidden, generator=g),
        "embed_tokens.weight": state["model.embed_tokens.weight"].clone(),
    }
    stored = dict(extras)
    if not own_head:  # as GLM-4.5's: the MTP uses the model's embedding and LM head
        extras["shared_head.head.weight"] = state["lm_head.weight"]
        del stored["shared_head.head.weight"], stored["embed_tokens.weight"]
    mtp.update({layer_prefix + k: v for k, v in stored.items()})
    from safetensors.torch import load_file, save_file

    files = sorted(path.glob("*.safetensors"))
    assert len(files) == 1, files
    tensors = load_file(str(files[0]))
    save_file({**tensors, **mtp}, str(files[0]), metadata={"format": "pt"})

    # the reference: the MTP's decoder layer as layer 0 of a one-layer sparse model
    ref_extra = {"num_hidden_layers": 1}
    if "mlp_layer_types" in extra:
        ref_extra["mlp_layer_types"] = ["sparse"]
    else:
        ref_extra["first_k_dense_replace"] = 0
    ref = random_eager_model(tiny_deepseek_config(arch, **ref_extra))
    ref_state = {
        k.replace(layer_prefix, "model.layers.0."): v
        for k, v in mtp.items()
        if k.removeprefix(layer_prefix) not in extras
    }
    ref_state["model.norm.weight"] = extras["shared_head.norm.weight"]
    ref_state["lm_head.weight"] = extras["shared_head.head.weight"]
    ref_state["model.embed_tokens.weight"] = extras["embed_tokens.weight"]
    ref.load_state_dict(ref_state)

    def mtp_input(token_ids: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """eh_proj([enorm(embed(token)); hnorm(state)]) per row."""
        e = extras["embed_tokens.weight"][token_ids]
        return (
            torch.cat(
                (_rms(e, extras["enorm.weight"], eps), _rms(states, extras["hnorm.weight"], eps)),
                dim=-1,
            )
            @ extras["eh_proj.weight"].T
        )

    @torch.no_grad()
    def reference(tokens: list[int], drafts: list[int] = ()) -> list[torch.Tensor]:
        """Logits of each MTP draft after `tokens`: the first from the target's hidden states,
        each later one from the MTP's own output state and the draft before it (teacher-forced
        on `drafts`, the drafts being checked)."""
        ids = torch.tensor([tokens])
        h = main.model(input_ids=ids[:, :-1]).last_hidden_state[0]  # [len - 1, hidden]
        x = mtp_input(ids[0, 1:], h)  # row p: the state at p and the token at p + 1
        captured = {}

        def keep_output(module, args, output):
            captured["state"] = output[0] if isinstance(output, tuple) else output

        hook = ref.model.layers[0].register_forward_hook(keep_output)
        try:
            logits = [ref(inputs_embeds=x[None]).logits[0, -1]]
            for draft in drafts[: len(drafts) - 1]:
                state = captured["state"][0, -1]  # the layer's output, before the final norm
                x = torch.cat((x, mtp_input(torch.tensor([draft]), state[None])))
                logits.append(ref(inputs_embeds=x[None]).logits[0, -1])
        finally:
            hook.remove()
        return logits

    return path, reference
