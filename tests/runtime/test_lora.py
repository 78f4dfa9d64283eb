"""Multi-LoRA (atom.lora) against PEFT: random adapters made with `peft` on a tiny random
Llama give PEFT's merged model's greedy tokens, each adapter and the base model in ONE batch,
eagerly and under Dynamo (the traced forward reads the same static buffers, and an adapter
loaded after compilation needs no recompile); the prefix cache keeps adapters apart; the
HTTP surface (adapters as models, vLLM's load/unload endpoints behind the API key,
vllm:lora_requests_info) works end to end. Everything shares one checkpoint and its PEFT
references (module fixture)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from atom.config import Config  # noqa: E402
from atom.engine import LLMEngine, SamplingParams  # noqa: E402
from atom.lora import LoRAConfig  # noqa: E402

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              bos_token_id=1, eos_token_id=2)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, target modules, rsLoRA): ranks below --max-lora-rank are zero-padded
ADAPTERS = {"a": (4, ALL, False), "b": (8, ["q_proj", "v_proj", "down_proj"], True)}
PROMPTS = [[1, 17, 33, 5, 90, 12, 7], [1] + list(range(20, 60))]  # the second: 2+ blocks
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@dataclass
class Setup:
    checkpoint: str
    adapters: dict[str, str]  # name -> directory
    refs: dict[str | None, list[list[int]]]  # adapter (None: base) -> tokens per prompt


def _base_model() -> transformers.PreTrainedModel:
    torch.manual_seed(1234)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**COMMON, tie_word_embeddings=False)).eval()
    with torch.no_grad():  # larger than default, so tokens differ clearly between logits
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.08)
    return model


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    root = tmp_path_factory.mktemp("lora")
    checkpoint = str(root / "base")
    _base_model().save_pretrained(checkpoint)
    adapters, refs = {}, {}
    for seed, (name, (rank, targets, rs)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed)
        model = peft.get_peft_model(
            transformers.LlamaForCausalLM.from_pretrained(checkpoint),
            peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                            use_rslora=rs, init_lora_weights=False))
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_" in pname:
                    p.normal_(0.0, 0.3)
        adapters[name] = str(root / name)
        model.save_pretrained(adapters[name])
    for name in [None, *adapters]:
        model = transformers.LlamaForCausalLM.from_pretrained(checkpoint).eval()
        if name is not None:  # PEFT's own merge is the reference
            model = peft.PeftModel.from_pretrained(model, adapters[name]).merge_and_unload()
        refs[name] = [
            model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
            for p in PROMPTS]
    assert len({str(r) for r in refs.values()}) == len(refs), "the adapters must change tokens"
    return Setup(checkpoint, adapters, refs)


def _engine(setup: Setup, modules: dict[str, str], level: int = 0,
            **kw: object) -> LLMEngine:
    cfg = Config(model=setup.checkpoint, dtype="float32", device="cpu", num_kv_blocks=64,
                 compilation_config={"level": level},
                 lora_config=LoRAConfig(modules=modules, max_loras=2, max_lora_rank=8), **kw)
    engine = LLMEngine(cfg)
    engine.warmup()
    return engine


def _run_mixed(engine: LLMEngine) -> dict[tuple[str | None, int], list[int]]:
    """Every (adapter, prompt) pair in one batch: base rows next to each adapter's."""
    out: dict[str, list[int]] = {}
    keys = {}
    for name in [None, *ADAPTERS]:
        for i, prompt in enumerate(PROMPTS):
            rid = f"{name}-{i}"
            keys[rid] = (name, i)
            engine.add_request(rid, prompt, GREEDY, lora_name=name)
            out[rid] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    return {keys[rid]: toks for rid, toks in out.items()}


def _expected(setup: Setup) -> dict[tuple[str | None, int], list[int]]:
    return {(name, i): toks for name, per in setup.refs.items() for i, toks in enumerate(per)}


@pytest.fixture(scope="module")
def eager(setup: Setup) -> LLMEngine:
    """Level 0, both adapters from the start (shared: each test leaves it idle)."""
    return _engine(setup, setup.adapters)


def test_mixed_batch_matches_peft_merged_models_eagerly(setup: Setup, eager: LLMEngine) -> None:
    engine = eager
    assert _run_mixed(engine) == _expected(setup)
    with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'"):
        engine.add_request("x", PROMPTS[0], GREEDY, lora_name="nope")


@pytest.mark.slow  # ~25 s: Dynamo traces the tiny model's forward on 2 shared cores
def test_compiled_forward_reads_the_same_buffers_and_loads_without_recompiling(
        setup: Setup) -> None:
    """Level 1 (the whole model under Dynamo): adapter b is loaded after compilation, into the
    buffers the traced code reads; tokens still match and Dynamo traced nothing more."""
    engine = _engine(setup, {"a": setup.adapters["a"]}, level=1)
    assert engine.lora is not None
    engine.lora.load("b", setup.adapters["b"])
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert _run_mixed(engine) == _expected(setup)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == before
    engine.lora.unload("a")
    with pytest.raises(ValueError, match="unknown LoRA adapter 'a'"):
        engine.add_request("x", PROMPTS[0], GREEDY, lora_name="a")


def test_prefix_cache_keeps_adapters_apart(setup: Setup) -> None:
    engine = _engine(setup, setup.adapters)  # its own: the cache starts empty
    prompt, full = PROMPTS[1], len(PROMPTS[1]) // 16 * 16

    def run(rid: str, name: str | None) -> tuple[list[int], int]:
        engine.add_request(rid, prompt, GREEDY, lora_name=name)
        toks, cached = [], 0
        while engine.has_unfinished_requests():
            for o in engine.step():
                toks += o.new_token_ids
                cached = max(cached, o.num_cached_tokens)
        return toks, cached

    assert run("base", None) == (setup.refs[None][1], 0)
    assert run("a1", "a") == (setup.refs["a"][1], 0)  # the base model's blocks: not a's
    assert run("b1", "b") == (setup.refs["b"][1], 0)
    assert run("a2", "a") == (setup.refs["a"][1], full)  # a's own blocks, reused
    assert run("base2", None) == (setup.refs[None][1], full)
    with pytest.raises(ValueError, match="in use"):
        engine.add_request("busy", prompt, GREEDY, lora_name="b")
        assert engine.lora is not None
        engine.lora.unload("b")


def test_http_adapters_as_models_load_unload_and_metrics(setup: Setup) -> None:
    import httpx

    from atom.entrypoints.api_server import serve
    from atom.entrypoints.core.client import ThreadCore
    from atom.entrypoints.state import ServerState
    from atom.tokenizer import ByteTokenizer
    from atom_devtools.localprocs import free_port

    key = {"Authorization": "Bearer k"}

    async def main() -> None:
        port = free_port()
        state = ServerState(engine=ThreadCore(lambda: _engine(setup, {"a": setup.adapters["a"]})),
                            served_model_name="base", model="base", api_key="k")
        state.tokenizer, state.max_model_len, state.vocab_size = ByteTokenizer(256), 256, 256
        stop = asyncio.Event()
        server = asyncio.create_task(serve(state, "127.0.0.1", port, grace_s=2.0, stop=stop,
                                           install_signals=False))
        base = f"http://127.0.0.1:{port}"
        try:
            async with httpx.AsyncClient(base_url=base, timeout=60) as c:
                for _ in range(600):
                    try:
                        if (await c.get("/health")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    await asyncio.sleep(0.05)

                async def models() -> dict[str, str | None]:
                    data = (await c.get("/v1/models", headers=key)).json()["data"]
                    return {m["id"]: m.get("parent") for m in data}

                async def complete(model: str) -> httpx.Response:
                    body = {"model": model, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS,
                            "temperature": 0, "ignore_eos": True}
                    return await c.post("/v1/completions", json=body, headers=key)

                assert await models() == {"base": None, "a": "base"}
                load = {"lora_name": "b", "lora_path": setup.adapters["b"]}
                assert (await c.post("/v1/load_lora_adapter", json=load)).status_code == 401
                r = await c.post("/v1/load_lora_adapter", json=load, headers=key)
                assert r.status_code == 200 and "'b' added" in r.text
                again = await c.post("/v1/load_lora_adapter", json=load, headers=key)
                assert again.status_code == 400 and "already loaded" in again.text
                assert await models() == {"base": None, "a": "base", "b": "base"}
                # one request per model at once: batched together in the engine
                answers = await asyncio.gather(*(complete(m) for m in ("base", "a", "b")))
                texts = {m: r.json()["choices"][0]["text"]
                         for m, r in zip(("base", "a", "b"), answers, strict=True)}
                tok = state.tokenizer
                assert tok is not None
                assert texts == {m: tok.decode(setup.refs[None if m == "base" else m][0])
                                 for m in texts}
                metrics = (await c.get("/metrics")).text
                assert 'vllm:lora_requests_info{max_lora="2"' in metrics
                r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "a"}, headers=key)
                assert r.status_code == 200 and "'a' removed" in r.text
                r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "a"}, headers=key)
                assert r.status_code == 404
                assert await models() == {"base": None, "b": "base"}
                assert (await complete("a")).status_code == 404  # no longer a model
        finally:
            stop.set()
            assert await asyncio.wait_for(server, 20) == 0

    asyncio.run(main())


def test_lora_flags_build_the_config() -> None:
    from atom.cli.args import build_parser
    from atom.cli.config import config_from_args

    args = build_parser().parse_args(["serve", "--model", "tiny-llama", "--device", "cpu",
                                      "--lora-modules", "x=/a", "y=/b", "--max-lora-rank", "8"])
    lora = config_from_args(args).lora_config
    assert lora == LoRAConfig(modules={"x": "/a", "y": "/b"}, max_loras=2, max_lora_rank=8)
    plain = build_parser().parse_args(["serve", "--model", "tiny-llama", "--device", "cpu"])
    assert config_from_args(plain).lora_config is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "m", "--lora-modules", "noequals"])
    with pytest.raises(ValueError, match="exceed max_loras"):
        LoRAConfig(modules={"x": "/a", "y": "/b"}, max_loras=1)
    assert Path(__file__).name == "test_lora.py"
