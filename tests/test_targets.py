"""The paper's target families on the one engine: tiny random targets built with transformers' own classes (Qwen3
tied and untied, with biases, with linear, dynamic and YaRN RoPE; Llama with the llama3 RoPE and biases; Qwen2 with
its q/k/v biases; Qwen3-MoE) decode at T = 0 exactly the target's greedy output, with drafts that accept; what the
engine does not compute is refused as it is built, naming the field."""

from __future__ import annotations

import pytest
import torch
import transformers
from support import greedy_reference, oracle_drafts

from blockpilot.decoding import GenerationConfig, GenerationRequest, forwards, generate_many
from blockpilot.decoding.engine import Engine
from blockpilot.decoding.forwards import StaticTarget
from blockpilot.models.loading import SpeculativeModels
from blockpilot.policies.fixed import FixedBlockSize
from blockpilot.zoo.random_models import ModelShape, drafter_for, random_target

VOCAB = 96
SHAPE = ModelShape(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                   block_size=4, max_positions=256, init_std=0.2)
YARN = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 64}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
TARGETS = {  # name -> (family, random_target's keywords)
    "qwen3": ("qwen3", {}),
    "qwen3-untied": ("qwen3", {"tie_word_embeddings": False}),
    "qwen3-yarn": ("qwen3", {"rope_parameters": YARN}),
    "qwen3-linear": ("qwen3", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}),
    "qwen3-dynamic": ("qwen3", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}),
    "qwen3-bias": ("qwen3", {"attention_bias": True}),
    "llama": ("llama", {}),
    "llama3-untied-bias": ("llama", {"rope_parameters": LLAMA3, "tie_word_embeddings": False, "attention_bias": True}),
    "qwen2": ("qwen2", {}),
    "qwen3-moe": ("qwen3_moe", {}),  # 8 experts, 2 a token: narrow steps gather them, wide ones run them all
}


def family_models(name: str) -> SpeculativeModels:
    family, keywords = TARGETS[name]
    target = random_target(VOCAB, SHAPE, family=family, seed=1, **keywords)
    drafter = drafter_for(target, SHAPE, mask_token_id=VOCAB - 1, seed=2)
    return SpeculativeModels(target, None, drafter, VOCAB - 1, target_id=name)


def prompts(count: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB - 1, (length,), generator=generator).tolist() for length in (5, 23, 9, 40)[:count]]


@pytest.mark.parametrize("name", list(TARGETS))
def test_the_static_target_computes_each_familys_logits(name):
    """The engine's forward over its cache equals the family's own forward (transformers' class), to float rounding:
    the RoPE's tables, the norms and the biases come from the model it loads."""
    models = family_models(name)
    target = StaticTarget(models.target, rows=2, capacity=128, layer_ids=None)
    ids = torch.tensor(prompts(4)[3])[None].repeat(2, 1)
    positions = torch.arange(ids.shape[1])[None].expand(2, -1)
    mask = (torch.arange(128)[None, None, :] <= positions[:, :, None])[:, None]
    with torch.inference_mode():
        logits, _ = target(ids, positions, positions, mask)
        expected = models.target(ids).logits.float()
        # One token a row too (2 tokens of 2 routes each: an MoE target gathers its chosen experts).
        one, _ = target(ids[:, :1], positions[:, :1], positions[:, :1], mask[:, :, :1])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(one, expected[:, :1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", list(TARGETS))
def test_each_family_decodes_its_greedy_output_in_a_mixed_batch(name):
    """Four prompts of different lengths at b = 1, 2, 3, 4 in one batch (a random drafter: drafts mostly rejected)."""
    models = family_models(name)
    requests = [
        GenerationRequest(prompt, GenerationConfig(max_new_tokens=20), FixedBlockSize(b))
        for prompt, b in zip(prompts(4), (1, 2, 3, 4), strict=True)
    ]
    results = generate_many(models, requests, engine=Engine(models, max_batch=4))
    assert [r.token_ids for r in results] == [greedy_reference(models.target, p, 20) for p in prompts(4)]


@pytest.mark.parametrize("name", ["qwen3-yarn", "llama3-untied-bias", "qwen2", "qwen3-moe"])
@pytest.mark.parametrize("wrong", [False, True])
def test_drafts_that_accept_commit_several_tokens_a_cycle_and_the_output_stays_greedy(name, wrong, monkeypatch):
    """The drafter proposes the target's own continuation (with `wrong`, one slot of each block replaced): each cycle
    commits several tokens, and the output is the target's greedy decoding."""
    models = family_models(name)
    prompt = prompts(2)[1]
    greedy = greedy_reference(models.target, prompt, 32)
    reference = prompt + greedy
    wrong_positions = range(len(prompt) + 2, len(reference), 4) if wrong else ()
    oracle_drafts(monkeypatch, models.target, reference, wrong_positions)
    requests = [GenerationRequest(prompt, GenerationConfig(max_new_tokens=32), FixedBlockSize(b)) for b in (2, 4)]
    results = generate_many(models, requests, engine=Engine(models, max_batch=2))
    assert [r.token_ids for r in results] == [greedy, greedy]
    widest = results[1]
    assert len(widest.token_ids) / widest.cycles > (1.5 if wrong else 3.0)


@pytest.mark.slow
def test_a_moe_target_compiled_decodes_its_greedy_output(monkeypatch, caplog):
    """The compiled cycle (inductor) over a Qwen3-MoE target, one row at b = 2: its 2-token steps gather their
    chosen experts (the wide form is the einsum over every expert, compiled in the same way: checked by hand), and
    its projections are the fused few-row products (`forwards.linear`), whatever this CPU's MKL measured. A replica's
    compiled prefill (symbolic lengths: the einsum) takes prompts of any length without falling back, the logits the
    eager pass's."""
    monkeypatch.setattr(forwards, "few_rows", forwards.FEW_ROWS)
    models = family_models("qwen3-moe")
    requests = [GenerationRequest(prompts(1)[0], GenerationConfig(max_new_tokens=16), FixedBlockSize(2))]
    engine = Engine(models, max_batch=1, width=2, capacity=96, compile="compile")
    results = generate_many(models, requests, engine=engine)
    assert results[0].token_ids == greedy_reference(models.target, prompts(1)[0], 16)
    assert engine.decoder.built_shapes == [("_cycle", 1, 96, 2, False, False)]
    decoder = engine.decoder
    decoder.compile_prefill()  # warmed up on 2 tokens, where the narrow form would gather
    decoder.steps.frozen = True
    with caplog.at_level("WARNING", logger="blockpilot.decoding.steps"):
        for prompt in prompts(4)[1:]:
            logits, _ = decoder.prefill(0, [torch.tensor(prompt)], context=False)
            expected = models.target(torch.tensor([prompt])).logits[:, -1].float()
            torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert "would compile again" not in caplog.text


def _tiny_config(kind: str):
    """The config of a tiny target of a family (or a variant) the engine's forward does not compute exactly."""
    shape = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
    if kind == "gemma3":
        return transformers.Gemma3TextConfig(**shape)
    if kind == "gpt-oss":
        return transformers.GptOssConfig(**shape, num_local_experts=4, num_experts_per_tok=2)
    if kind == "qwen3.5":
        return transformers.Qwen3_5TextConfig(**shape)
    if kind == "llama-mlp-bias":
        return transformers.LlamaConfig(**shape, mlp_bias=True)
    extra = {
        "sliding": {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
        "longrope": {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4,
                                         "long_factor": [2.0] * 4, "original_max_position_embeddings": 64}},
    }[kind]
    return transformers.Qwen3Config(**shape, **extra)


@pytest.mark.parametrize(
    "kind, field",
    [("gemma3", "model_type"), ("gpt-oss", "model_type"), ("qwen3.5", "model_type"),
     ("sliding", "layer_types"), ("longrope", "rope_type"), ("llama-mlp-bias", "mlp_bias")],
)
def test_a_target_the_forward_cannot_compute_exactly_is_refused_naming_the_field(kind, field):
    """Refused as the engine is built (every command builds it right after loading), never decoded wrong."""
    config = _tiny_config(kind)
    target = transformers.AutoModelForCausalLM.from_config(config).eval()
    models = SpeculativeModels(target, None, None, None)
    with pytest.raises(ValueError, match=f"target {field} = .*refused rather than decoded wrong"):
        Engine(models)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3_moe"])
def test_the_cli_decodes_each_familys_greedy_output(family, tmp_path, capsys):
    """`blockpilot zoo random --family F`, then `blockpilot generate` on it (in process; eager here, the compiled
    cycle is the slow test above): the target's greedy decoding."""
    import json

    from blockpilot.cli import main
    from blockpilot.models import load_models

    assert main(["zoo", "random", "--family", family, "--out", str(tmp_path / "zoo")]) == 0
    models = f"--target {tmp_path / 'zoo' / 'target'} --drafter {tmp_path / 'zoo' / 'drafter'}"
    capsys.readouterr()
    generate = f"generate {models} --prompt Count --max-new-tokens 16 --policy fixed:3 --compile off --json"
    assert main(generate.split()) == 0
    payload = json.loads(capsys.readouterr().out)
    loaded = load_models(tmp_path / "zoo" / "target", tmp_path / "zoo" / "drafter", device="cpu")
    assert loaded.target.config.model_type == family
    expected = greedy_reference(loaded.target, loaded.encode_prompt("Count"), 16, loaded.stop_token_ids())
    assert payload["token_ids"] == expected
