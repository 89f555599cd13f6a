"""``kvatlas node --hf-config``: the KV layout from a Hugging Face ``config.json`` (real shapes
of published models), refusals for what is missing, contradictory or not re-RoPE-able, and a
layout flag that contradicts the file refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvatlas.cli import _build_parser
from kvatlas.node.config import NodeConfig, config_from_args
from kvatlas.node.hf_config import HfConfigError, hf_layout, read_hf_config

# Verbatim layout fields of published config.json files (other fields trimmed).
LLAMA_3_8B = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 8192, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "rope_scaling": None,
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}  # fmt: skip
QWEN2_0_5B = {  # tied embeddings, sliding-window fields present but unused
    "architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "intermediate_size": 4864,
    "max_position_embeddings": 131072, "max_window_layers": 24, "model_type": "qwen2",
    "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
    "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936,
}  # fmt: skip
MISTRAL_7B = {
    "architectures": ["MistralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "rope_theta": 10000.0,
    "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "vocab_size": 32000,
}  # fmt: skip
MISTRAL_NEMO = {  # head_dim 128 stated; hidden_size / heads would say 160
    "architectures": ["MistralForCausalLM"], "head_dim": 128, "hidden_size": 5120,
    "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 40,
    "num_key_value_heads": 8, "rope_theta": 1000000.0, "sliding_window": None,
    "torch_dtype": "bfloat16", "vocab_size": 131072,
}  # fmt: skip
QWEN3_8B_V5 = {  # transformers v5 spelling: dtype, rope_parameters
    "architectures": ["Qwen3ForCausalLM"], "head_dim": 128, "hidden_size": 4096,
    "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 36,
    "num_key_value_heads": 8, "dtype": "bfloat16",
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
}  # fmt: skip
GPTJ_6B = {  # interleaved, partial rotary, no rope_theta in the file
    "architectures": ["GPTJForCausalLM"], "model_type": "gptj", "n_embd": 4096, "n_head": 16,
    "n_layer": 28, "rotary_dim": 64, "torch_dtype": "float16",
}  # fmt: skip


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (LLAMA_3_8B, (32, 8, 128, "bfloat16", 500000.0, None, "neox")),
        (QWEN2_0_5B, (24, 2, 64, "bfloat16", 1000000.0, None, "neox")),
        (MISTRAL_7B, (32, 8, 128, "bfloat16", 10000.0, None, "neox")),
        (MISTRAL_NEMO, (40, 8, 128, "bfloat16", 1000000.0, None, "neox")),
        (QWEN3_8B_V5, (36, 8, 128, "bfloat16", 1000000.0, None, "neox")),
        (GPTJ_6B, (28, 16, 256, "float16", None, 64, "gptj")),
    ],
)
def test_published_configs(config: dict[str, Any], expected: tuple[object, ...]) -> None:
    got = hf_layout(config)
    assert (got.num_layers, got.num_kv_heads, got.head_dim, got.dtype, got.rope_theta,
            got.rotary_dim, got.rope_style) == expected  # fmt: skip


def test_multimodal_text_config_and_mha_default() -> None:
    llava = {"model_type": "llava", "torch_dtype": "float16",
             "text_config": {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32,
                             "num_hidden_layers": 32, "rope_theta": 10000.0}}  # fmt: skip
    got = hf_layout(llava)
    assert (got.num_layers, got.num_kv_heads, got.head_dim, got.dtype) == (32, 32, 128, "float16")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_hidden_layers": None}, "no num_hidden_layers"),
        ({"num_attention_heads": None}, "no num_attention_heads"),
        ({"num_hidden_layers": 0}, "positive integer"),
        ({"num_key_value_heads": 8.5}, "positive integer"),
        ({"hidden_size": 4097}, "not a multiple"),
        ({"dtype": "float16"}, "contradictory"),  # torch_dtype says bfloat16
        ({"torch_dtype": "float8_e4m3fn"}, "not a KV dtype"),
        ({"n_layer": 30}, "contradictory"),  # num_hidden_layers says 32
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rescales"),  # Llama-3.1
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rescales"),
        ({"rope_parameters": {"rope_theta": 10000.0}}, "contradictory RoPE bases"),
        (
            {
                "rope_parameters": {
                    "full_attention": {"rope_theta": 1e6},
                    "sliding_attention": {"rope_theta": 1e4},
                }
            },
            "contradictory",
        ),
        ({"rope_theta": 1.0}, "> 1"),
        ({"partial_rotary_factor": 0.5, "rotary_dim": 32}, "contradictory rotary"),
        ({"partial_rotary_factor": 0.3}, "even count"),
        ({"kv_lora_rank": 512}, "MLA"),  # DeepSeek-V2/V3
    ],
)
def test_refusals(change: dict[str, Any], message: str) -> None:
    with pytest.raises(HfConfigError, match=message):
        hf_layout({**LLAMA_3_8B, **change})


def test_per_layer_type_thetas_that_agree_are_one_base() -> None:
    both = {"full_attention": {"rope_theta": 1e6, "rope_type": "default"},
            "sliding_attention": {"rope_theta": 1e6, "rope_type": "default"}}  # fmt: skip
    config = {**LLAMA_3_8B, "rope_theta": None, "rope_parameters": both}
    assert hf_layout(config).rope_theta == 1e6


def test_unreadable_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(HfConfigError, match="cannot read"):
        read_hf_config(tmp_path / "nope.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(HfConfigError, match="not JSON"):
        read_hf_config(tmp_path)  # a directory means its config.json
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(HfConfigError, match="no JSON object"):
        read_hf_config(tmp_path)


def write(tmp_path: Path, config: dict[str, Any]) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def node_config(*argv: str, environ: dict[str, str] | None = None) -> NodeConfig:
    return config_from_args(_build_parser().parse_args(["node", *argv]), environ or {})


def test_the_node_flag_sets_the_layout(tmp_path: Path) -> None:
    layout = node_config("--hf-config", str(write(tmp_path, LLAMA_3_8B))).layout
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype) == (
        32, 8, 128, "bfloat16",
    )  # fmt: skip
    assert (layout.rope_theta, layout.rope_dim, layout.rope_style) == (500000.0, 128, "neox")
    # tensor parallelism: a rank holds its share of the KV heads
    ranked = node_config("--hf-config", str(tmp_path), "--world-size", "2", "--rank", "1")
    assert ranked.layout.num_kv_heads == 4


def test_a_contradicting_layout_flag_is_refused(tmp_path: Path) -> None:
    path = str(write(tmp_path, LLAMA_3_8B))
    with pytest.raises(ValueError, match="--num-layers 30 contradicts --hf-config"):
        node_config("--hf-config", path, "--num-layers", "30")
    with pytest.raises(ValueError, match="--dtype float16 contradicts"):
        node_config("--hf-config", path, "--dtype", "float16")  # the default value, given
    with pytest.raises(ValueError, match=r"--rope-theta 10000\.0 contradicts"):
        node_config("--hf-config", path, environ={"KVATLAS_ROPE_THETA": "10000"})
    with pytest.raises(ValueError, match="--num-kv-heads 8 contradicts"):
        node_config("--hf-config", path, "--num-kv-heads", "8", "--world-size", "2")
    # a flag that agrees with the file is fine
    assert node_config("--hf-config", path, "--num-layers", "32", "--head-dim", "128")


def test_what_the_file_does_not_state_must_be_given(tmp_path: Path) -> None:
    path = str(write(tmp_path, GPTJ_6B))
    with pytest.raises(ValueError, match=r"does not state the rope_theta.*give --rope-theta"):
        node_config("--hf-config", path)
    layout = node_config("--hf-config", path, "--rope-theta", "10000").layout
    assert (layout.rope_dim, layout.rope_style, layout.head_dim) == (64, "gptj", 256)
    phi = {**LLAMA_3_8B, "model_type": "phi", "partial_rotary_factor": 0.5}
    with pytest.raises(ValueError, match="does not state the rope_style"):
        node_config("--hf-config", str(write(tmp_path, phi)))
    assert node_config("--hf-config", str(tmp_path), "--rope-style", "neox").layout.rope_dim == 64


def test_without_the_flag_the_defaults_hold() -> None:
    config = NodeConfig()
    assert (config.num_layers, config.num_kv_heads, config.head_dim, config.dtype) == (
        2, 2, 64, "float16",
    )  # fmt: skip
    assert NodeConfig(num_layers=4).layout.num_layers == 4
