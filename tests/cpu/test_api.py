"""The library API (``dflash.load``): generate, stream, chat, stop strings, typed errors.

One default pair is loaded for the module; generations are short (the default pair is
small, but the machine may be shared).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

import dflash
from dflash.api import LLM, STREAM_THREAD, ArgumentError
from dflash.cli import main
from dflash.data import default_dir, missing_files
from dflash.errors import UsageError
from dflash.execution import RollbackConfigError, RollbackStatus, reference_greedy, token_sha256
from dflash.model.tokenizer import TextEncodingError

pytestmark = pytest.mark.skipif(
    bool(missing_files("target") or missing_files("drafter")),
    reason="the embedded default pair is not installed",
)

PROMPT = "def read_lines(path):\n"
N = 12


@pytest.fixture(scope="module")
def llm() -> LLM:
    return dflash.load()


@pytest.fixture(scope="module")
def first(llm: LLM) -> dflash.GenerationResult:
    """The module's first generation: the one that runs the capture gate."""
    return llm.generate(PROMPT, max_new_tokens=N)


@pytest.fixture(scope="module")
def pieces(llm: LLM, first: dflash.GenerationResult) -> list[str]:
    stream = llm.stream(PROMPT, max_new_tokens=N)
    got = list(stream)
    assert stream.result.tokens == first.tokens
    assert "".join(got) == stream.result.text == first.text
    return got


def test_generate_by_text_and_by_ids_keeps_the_engine(
    llm: LLM, first: dflash.GenerationResult
) -> None:
    assert llm.tokenizer is not None
    ids = llm.tokenizer.encode(PROMPT)
    assert first.prompt_len == len(ids) and len(first.tokens) == N
    assert first.text == llm.tokenizer.decode(first.tokens)
    assert first.rollback.requested == "checkpoint"  # the one default: fast requested
    assert first.rollback.status_at_start is RollbackStatus.REQUESTED
    assert first.capture.verdict == "validated"
    engine = llm.engine
    again = llm.generate(ids, max_new_tokens=N)
    assert again.tokens == first.tokens and llm.engine is engine
    # the kept engine's verdict holds: no second gate run, fast from the first step
    assert again.rollback.status_at_start is RollbackStatus.EFFECTIVE
    assert again.rollback.replay == 0 and again.rollback.fast == again.steps
    assert again.capture.validated_at_step == first.capture.validated_at_step


def test_plain_decoding_is_the_parity_oracle(llm: LLM, first: dflash.GenerationResult) -> None:
    plain = dflash.load(draft=None)
    assert llm.tokenizer is not None
    ids = llm.tokenizer.encode(PROMPT)
    result = plain.generate(PROMPT, max_new_tokens=N)
    assert result.tokens == first.tokens  # speculative == plain, token for token
    assert result.tokens == reference_greedy(plain.model, plain.plan, ids, N)
    # the steps' forwards, the prefill not counted, as a speculative result counts them
    assert result.target_forwards == result.steps == N - 1
    assert first.target_forwards == round(first.steps * first.target_forwards_per_step)
    assert result.rollback.status is RollbackStatus.OFF
    assert result.text == first.text and result.stop_reason == "max_new_tokens"


def test_recompute_rollback_from_the_library(first: dflash.GenerationResult) -> None:
    """``rollback="recompute"``: the same tokens, the recurrence's inputs as its capture
    storage (a fraction of the checkpoint bytes), fast rollback effective."""
    result = dflash.load(rollback="recompute").generate(PROMPT, max_new_tokens=N)
    assert result.tokens == first.tokens
    assert result.rollback.requested == "recompute"
    assert result.rollback.status is RollbackStatus.EFFECTIVE and result.rollback.fast > 0
    assert set(result.capture_bytes) == {"inputs", "g", "beta", "captured", "snapshot"}
    assert result.checkpoint_bytes == sum(result.capture_bytes.values())
    assert result.checkpoint_bytes < first.checkpoint_bytes / 2


def test_stream_pieces_concatenate_to_the_text(pieces: list[str]) -> None:
    assert len([p for p in pieces if p]) > 1  # streamed as committed, not in one piece
    assert all(pieces)


def _check_cut(llm: LLM, full: str, stop: str, result: dflash.GenerationResult,
               first: dflash.GenerationResult) -> None:
    """``result``: text up to the stop string; tokens whose text ends before it."""
    assert llm.tokenizer is not None
    at = full.find(stop)
    assert result.stop_reason == "stop" and result.text == full[:at]
    kept = len(result.tokens)
    assert result.tokens == first.tokens[:kept]
    assert len(llm.tokenizer.decode(result.tokens)) <= at
    assert len(llm.tokenizer.decode(first.tokens[: kept + 1])) > at  # the next one reaches it
    assert result.sha256 == token_sha256(result.tokens)


def test_stop_strings_cut_text_and_tokens(
    llm: LLM, first: dflash.GenerationResult, pieces: list[str]
) -> None:
    full = first.text
    assert full is not None
    # a stop string spanning two streamed pieces: the last character of one and the first
    # of the next, where that pair first occurs at the pieces' boundary
    boundaries = [sum(map(len, pieces[: i + 1])) for i in range(len(pieces) - 1)]
    spans = [full[b - 1 : b + 1] for b in boundaries if full.find(full[b - 1 : b + 1]) == b - 1]
    assert spans, f"no piece boundary to test in {pieces!r}"
    stop = spans[-1]
    stream = llm.stream(PROMPT, max_new_tokens=N, stop=["never in the text", stop])
    got = list(stream)
    assert "".join(got) == full[: full.find(stop)]
    _check_cut(llm, full, stop, stream.result, first)
    cut = llm.generate(PROMPT, max_new_tokens=N, stop=stop)
    same = ("tokens", "sha256", "text", "stop_reason")
    assert [getattr(cut, f) for f in same] == [getattr(stream.result, f) for f in same]
    missing = llm.generate(PROMPT, max_new_tokens=N, stop="never in the text")
    assert missing.tokens == first.tokens and missing.stop_reason == "max_new_tokens"
    # the decode itself ends at the step that completed the stop string
    early = llm.generate(PROMPT, max_new_tokens=N, stop=spans[0])
    assert early.stop_reason == "stop" and early.steps < missing.steps
    plain = dflash.load(draft=None).generate(PROMPT, max_new_tokens=N, stop=spans[0])
    assert plain.tokens == early.tokens and plain.steps < N - 1


def test_closing_a_stream_early_frees_the_llm(llm: LLM, first: dflash.GenerationResult) -> None:
    stream = llm.stream(PROMPT, max_new_tokens=N)
    next(iter(stream))
    with pytest.raises(ArgumentError, match="another generation is running"):
        llm.generate(PROMPT, max_new_tokens=2)
    stream.close()
    with pytest.raises(ArgumentError, match="once its pieces have all been read"):
        stream.result  # noqa: B018 - the property raises
    assert llm.generate(PROMPT, max_new_tokens=N).tokens == first.tokens


def test_a_stream_left_by_break_stops_and_frees_the_llm(
        llm: LLM, first: dflash.GenerationResult) -> None:
    """Leaving the loop that reads a stream (``break``, or an exception in the reader)
    drops the stream; it is collected at once and stops its decode at the next step, so
    the next call runs instead of finding the LLM busy."""
    import threading
    import weakref

    pieces = 0
    for _ in llm.stream(PROMPT, max_new_tokens=N):
        pieces += 1
        break
    assert pieces == 1
    assert llm.generate(PROMPT, max_new_tokens=N).tokens == first.tokens

    def read_one_then_fail() -> weakref.ref[dflash.TextStream]:
        stream = llm.stream(PROMPT, max_new_tokens=N)
        ref = weakref.ref(stream)
        try:
            for _ in stream:
                raise KeyError("the reader failed")
        except KeyError:
            pass
        return ref

    ref = read_one_then_fail()
    assert ref() is None   # collected by reference counting: no cycle holds a stream
    assert llm.generate(PROMPT, max_new_tokens=N).tokens == first.tokens
    assert not [t for t in threading.enumerate() if t.name == STREAM_THREAD]


def test_every_eos_id_of_the_checkpoint_stops_the_generation(
        tmp_path: Path, first: dflash.GenerationResult,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A ``generation_config.json`` that lists several EOS ids (as Qwen's instruct models
    do): speculative and plain decoding, the library's streams and the CLI stop at the
    first token that is any of them, not only at the first id of the list."""
    directory = tmp_path / "target"
    shutil.copytree(default_dir("target"), directory)
    k = next(i for i in range(2, N) if first.tokens[i] not in first.tokens[:i])
    second = first.tokens[k]
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, second]}))
    want = first.tokens[: k + 1]
    for draft in ("dflash", None):
        llm = dflash.load(model=str(directory), draft=draft)
        assert llm.eos_ids == (0, second) and llm.eos_id == 0
        result = llm.generate(PROMPT, max_new_tokens=N)
        assert result.tokens == want and result.stop_reason == "eos", draft
        assert llm.tokenizer is not None
        assert result.text == llm.tokenizer.decode(want[:-1])   # the EOS is not text
        assert "".join(llm.stream(PROMPT, max_new_tokens=N)) == result.text
    assert main(["generate", "--model", str(directory), "--draft", str(default_dir("drafter")),
                 "--prompt", PROMPT, "--max-new-tokens", str(N), "--json",
                 "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == want and out["stop_reason"] == "eos"


def test_the_default_pair_chats_with_the_plain_template(llm: LLM) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert llm.render_chat(messages) == "system: be brief\nuser: hi\nassistant: "
    assert llm.render_chat(messages, add_generation_prompt=False) == (
        "system: be brief\nuser: hi\n"
    )
    result = llm.chat(messages, max_new_tokens=4)
    assert llm.tokenizer is not None
    assert result.prompt_len == len(llm.tokenizer.encode(llm.render_chat(messages)))


@pytest.fixture(scope="module")
def templated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    directory = tmp_path_factory.mktemp("chat") / "target"
    shutil.copytree(default_dir("target"), directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["bos_token"] = {"content": "<s>", "special": True}  # the AddedToken form
    config["chat_template"] = (
        "{{ bos_token }}{% for m in messages %}"
        "{% if m['role'] not in ['user', 'assistant'] %}"
        "{{ raise_exception('roles must be user or assistant') }}{% endif %}"
        "<|{{ m['role'] }}|>{{ m['content'] | trim }}{{ eos_token }}\n"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    yield directory


def test_chat_renders_the_checkpoint_template(templated: Path) -> None:
    chatty = dflash.load(model=str(templated), draft="prompt-lookup")
    messages = [{"role": "user", "content": " hi "}, {"role": "assistant", "content": "yes"}]
    assert chatty.render_chat(messages) == (
        "<s><|user|>hi<|endoftext|>\n<|assistant|>yes<|endoftext|>\n<|assistant|>"
    )
    with pytest.raises(ArgumentError, match=r"'messages': .*roles must be user or assistant"):
        chatty.chat([{"role": "tool", "content": "x"}])
    with pytest.raises(ArgumentError, match="'messages' entry 0 must be a dict"):
        chatty.chat([{"role": "user"}])
    # a chat_template.jinja file serves when tokenizer_config.json has none
    config = json.loads((templated / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (templated / "tokenizer_config.json").write_text(json.dumps(config))
    (templated / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    jinja = dflash.load(model=str(templated), draft=None)
    assert jinja.render_chat([{"role": "user", "content": "x = 1"}]) == "x = 1!"
    result = jinja.chat([{"role": "user", "content": "x = 1"}], max_new_tokens=3)
    assert result.prompt_len == len(chatty.tokenizer.encode("x = 1!"))  # type: ignore[union-attr]
    # as transformers reads them: the .jinja file first, even beside tokenizer_config's
    config["chat_template"] = "CFG {{ messages[0]['content'] }}"
    (templated / "tokenizer_config.json").write_text(json.dumps(config))
    both = dflash.load(model=str(templated), draft=None)
    assert both.render_chat([{"role": "user", "content": "x"}]) == "x!"
    # named templates without a 'default' one: refused, not the plain template
    (templated / "chat_template.jinja").unlink()
    config["chat_template"] = [{"name": "tool_use", "template": "T"}]
    (templated / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(dflash.api.ChatTemplateError, match="with a 'default' one"):
        dflash.load(model=str(templated), draft=None).render_chat(
            [{"role": "user", "content": "x"}])


def test_text_that_is_not_utf8_is_a_usage_error(llm: LLM) -> None:
    bad = b"def f(\xff):".decode("utf-8", "surrogateescape")  # as argv carries it
    with pytest.raises(TextEncodingError) as info:
        llm.generate(bad, max_new_tokens=2)
    assert str(info.value) == "'prompt' is not valid UTF-8: byte 0xff at offset 6"
    assert isinstance(info.value, UsageError)
    with pytest.raises(TextEncodingError, match=r"'prompt' .*lone surrogate U\+D800 at offset 2"):
        llm.generate("é\ud800", max_new_tokens=2)
    with pytest.raises(TextEncodingError, match="'stop' is not valid UTF-8"):
        llm.generate(PROMPT, max_new_tokens=2, stop="\udcff")


def test_the_cli_refuses_a_prompt_that_is_not_utf8(capsys: pytest.CaptureFixture[str]) -> None:
    bad = b"def f(\xff):".decode("utf-8", "surrogateescape")
    assert main(["generate", "--prompt", bad, "--max-new-tokens", "2", "--no-progress"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    assert "dflash generate: error: --prompt is not valid UTF-8: byte 0xff at offset 6" in err


def test_sampled_generation_is_plain_sampled_decoding_seed_for_seed(llm: LLM) -> None:
    """``temperature`` > 0: the speculative tokens equal plain sampled decoding's
    (``draft=None``) for the same seed, on the same kept engine as greedy requests; the
    seed decides the text, and greedy requests afterwards are greedy again."""
    plain = dflash.load(draft=None)
    rule = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.02}
    for seed in (1, 2):
        spec = llm.generate(PROMPT, max_new_tokens=N, seed=seed, **rule)  # type: ignore[arg-type]  # floats and ints
        ref = plain.generate(PROMPT, max_new_tokens=N, seed=seed, **rule)  # type: ignore[arg-type]  # floats and ints
        assert spec.tokens == ref.tokens, seed
        assert spec.sampling is not None and spec.sampling["seed"] == seed
    one = llm.generate(PROMPT, max_new_tokens=N, temperature=1.0, seed=3)
    other = llm.generate(PROMPT, max_new_tokens=N, temperature=1.0, seed=4)
    assert one.tokens != other.tokens
    assert llm.generate(PROMPT, max_new_tokens=N, temperature=1.0, seed=3).tokens == one.tokens
    greedy = llm.generate(PROMPT, max_new_tokens=N)
    assert greedy.sampling is None
    assert greedy.tokens == plain.generate(PROMPT, max_new_tokens=N).tokens


@pytest.mark.parametrize(
    ("option", "value", "match"),
    [("temperature", -0.5, r"'temperature' must be a number in \[0.0, 100.0\] \(got -0.5\)"),
     ("top_k", -1, "'top_k' must be an int"), ("top_p", 0.0, "'top_p' must be a number"),
     ("min_p", 2.0, "'min_p' must be a number"), ("seed", -1, "'seed' must be an int")],
)
def test_bad_sampling_arguments_are_named(
    llm: LLM, option: str, value: float, match: str
) -> None:
    with pytest.raises(ArgumentError, match=match):
        llm.generate(PROMPT, max_new_tokens=2, **{option: value})  # type: ignore[arg-type]  # bad on purpose


def test_load_refuses_bad_arguments_naming_them() -> None:
    with pytest.raises(ArgumentError, match=r"'tree_budget' must be an int in \[2, 1024\]"):
        dflash.load(tree_budget=1)
    with pytest.raises(ArgumentError, match="'tree_budget'=8 needs a drafter"):
        dflash.load(draft=None, tree_budget=8)
    with pytest.raises(ArgumentError, match="needs a drafter that gives per-slot candidates"):
        dflash.load(draft="prompt-lookup", tree_budget=8)
    with pytest.raises(ArgumentError, match=r"'dtype' must be one of float32, .*'float64'"):
        dflash.load(dtype="float64")
    with pytest.raises(UsageError, match=r"'device' entry 'tpu:0' is not a torch device"):
        dflash.load(device="tpu:0")
    with pytest.raises(UsageError, match=r"'layer_split' has 2 counts but 'device' names 1"):
        dflash.load(layer_split="3,3")
    with pytest.raises(RollbackConfigError, match=r"'rollback' must be one of .*'fastest'"):
        dflash.load(rollback="fastest")
    with pytest.raises(ArgumentError, match=r"'block_size' must be an int in \[2, 1024\]"):
        dflash.load(block_size=1)
    with pytest.raises(ArgumentError, match="'verify_window' must be one of auto, full"):
        dflash.load(verify_window="half")
    with pytest.raises(UsageError, match="'model' must be one of default, tiny"):
        dflash.load(model="/no/such/model")


def test_generate_refuses_bad_prompts_naming_them(llm: LLM) -> None:
    with pytest.raises(ArgumentError, match=r"'prompt' entry 1 must be a token id in \[0, 4096\)"):
        llm.generate([1, 5000], max_new_tokens=2)
    with pytest.raises(ArgumentError, match="'prompt' must not be empty"):
        llm.generate("", max_new_tokens=2)
    with pytest.raises(ArgumentError, match="'max_new_tokens' must be an int >= 1"):
        llm.generate(PROMPT, max_new_tokens=0)
    with pytest.raises(ArgumentError, match="'stop' must be a non-empty str"):
        llm.generate(PROMPT, max_new_tokens=2, stop=[""])
    seeded = dflash.load(model="tiny", draft=None)
    with pytest.raises(ArgumentError, match="'prompt' needs a tokenizer"):
        seeded.generate("hello", max_new_tokens=2)
    with pytest.raises(ArgumentError, match="'stream' needs a tokenizer"):
        seeded.stream([1, 2, 3], max_new_tokens=2)
    assert seeded.generate([1, 2, 3], max_new_tokens=3).text is None


def test_trees_in_the_library_are_plain_decoding(first: dflash.GenerationResult) -> None:
    """``tree_budget=N``: each step verifies a tree of at most ``N`` nodes grown from the
    shipped drafter's candidates (prompt lookup's copy a branch); the tokens are plain
    decoding's, greedy and seeded sampling, and the result reports the trees."""
    trees = dflash.load(tree_budget=8)
    r = trees.generate(PROMPT, max_new_tokens=N)
    assert r.tokens == first.tokens and r.tree_budget == 8
    assert r.nodes_per_step is not None and r.nodes_per_step > 1
    plain = dflash.load(draft=None)
    sampled = trees.generate(PROMPT, max_new_tokens=N, temperature=0.8, seed=3)
    assert sampled.tokens == plain.generate(PROMPT, max_new_tokens=N, temperature=0.8,
                                            seed=3).tokens
    streamed = trees.stream(PROMPT, max_new_tokens=N)
    assert "".join(streamed) == first.text and streamed.result.tokens == first.tokens


def test_prompts_as_numpy_ints_and_tensors_are_the_same_ids(llm: LLM) -> None:
    import numpy as np
    import torch

    ids = llm.encode(PROMPT)
    want = llm.generate(ids, max_new_tokens=4).tokens
    assert llm.generate([np.int64(t) for t in ids], max_new_tokens=4).tokens == want  # type: ignore[misc]  # numpy ints: accepted at run time, not in the annotation
    assert llm.generate(torch.tensor(ids), max_new_tokens=4).tokens == want
    with pytest.raises(ArgumentError, match="as a tensor must be 1-D of integer token ids"):
        llm.generate(torch.tensor([ids]), max_new_tokens=2)
    with pytest.raises(ArgumentError, match=r"\(got torch.float32 of shape \(2,\)\)"):
        llm.generate(torch.tensor([1.0, 2.0]), max_new_tokens=2)


@pytest.mark.parametrize("stop", [5, {"a": 1}, b"ab"])
def test_a_stop_that_is_not_strings_is_named(llm: LLM, stop: object) -> None:
    with pytest.raises(ArgumentError, match=r"'stop' must be a non-empty str or a list"):
        llm.generate(PROMPT, max_new_tokens=2, stop=stop)  # type: ignore[arg-type]  # bad on purpose


def test_a_temperature_too_small_for_float32_is_refused(llm: LLM) -> None:
    """Below 1e-05 the scaled logits overflow float32 (ties at +inf, drawn as the first):
    refused, not decoded into the lowest token id."""
    for t in (1e-38, 1e-300, 5e-324):
        with pytest.raises(ArgumentError, match=r"'temperature' must be 0 \(greedy\) or at "
                                                r"least 1e-05"):
            llm.generate(PROMPT, max_new_tokens=2, temperature=t)
    assert llm.generate(PROMPT, max_new_tokens=2, temperature=1e-5, seed=1).tokens


def test_load_takes_paths_an_int_split_and_a_float64_drafter() -> None:
    by_path = dflash.load(model=default_dir("target"), draft=None)
    assert by_path.generate(PROMPT, max_new_tokens=3).tokens == dflash.load(
        draft=None).generate(PROMPT, max_new_tokens=3).tokens
    assert dflash.load(draft=None, layer_split=8).plan.split == (8,)
    assert dflash.load(draft_dtype="float64").generate(PROMPT, max_new_tokens=3).tokens
    with pytest.raises(UsageError, match="'draft_dtype'=float64 applies to DFlash drafters"):
        dflash.load(draft="prompt-lookup", draft_dtype="float64")
    with pytest.raises(UsageError, match="'layer_split' must be a comma-separated str"):
        dflash.load(draft=None, layer_split=8.0)  # type: ignore[arg-type]  # bad on purpose


def test_plain_decoding_may_fill_the_model_window(llm: LLM) -> None:
    """Plain decoding writes no verify past the committed tokens: a prompt may ask for
    every position the model has (``room``); speculative decoding keeps a verify's slots."""
    plain = dflash.load(draft=None)
    limit = plain.model.config.max_position_embeddings
    prompt = [5] * (limit - 20)
    assert plain.room(len(prompt)) == 21 and llm.room(len(prompt)) == 6
    assert len(plain.generate(prompt, max_new_tokens=21).tokens) >= 1
    with pytest.raises(UsageError, match=r"\+ max_new_tokens=22 - 1 = 8193 positions exceed "
                                         r".* \(at most 21 new tokens fit\)"):
        plain.generate(prompt, max_new_tokens=22)
    with pytest.raises(UsageError, match=r"a last verify of 16 slots - 2 = 8206 positions .* "
                                         r"\(at most 6 new tokens fit\)"):
        llm.generate(prompt, max_new_tokens=20)


def test_a_chat_template_is_checked_when_it_is_set(llm: LLM, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }", encoding="utf-8")
    before = llm.render_chat([{"role": "user", "content": "x"}])
    with pytest.raises(dflash.api.ChatTemplateError, match=r"bad\.jinja' is not valid"):
        llm.use_chat_template(bad)
    with pytest.raises(ArgumentError, match=r"'path' must be a str or a path \(got None\)"):
        llm.use_chat_template(None)  # type: ignore[arg-type]  # bad on purpose
    assert llm.render_chat([{"role": "user", "content": "x"}]) == before


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_a_step_cut_short_leaves_the_llm_usable(error: type[BaseException]) -> None:
    """Ctrl-C or a device error inside a verify forward leaves the kept target mid-step:
    the next calls build a fresh one and give a fresh LLM's tokens (they used to be
    refused for good: "needs a clean target")."""
    llm = dflash.load()
    llm.generate(PROMPT, max_new_tokens=4)
    target = llm.target
    assert target is not None
    real = target._forward
    seen = [0]

    def failing(ids: object, mode: str, *args: object) -> object:
        if mode == "verify":
            seen[0] += 1
            if seen[0] == 3:
                raise error("cut short")
        return real(ids, mode, *args)  # type: ignore[arg-type]  # passed through as given

    target._forward = failing  # type: ignore[method-assign,assignment]  # the fault
    with pytest.raises(error, match="cut short"):
        llm.generate(PROMPT, max_new_tokens=40)
    assert seen[0] == 3 and llm.target is None and llm.engine is None
    fresh = dflash.load()
    for rule in ({}, {"temperature": 0.8, "seed": 2}):
        assert llm.generate("import os\n", max_new_tokens=12, **rule).tokens == (  # type: ignore[arg-type]  # the rule's keywords
            fresh.generate("import os\n", max_new_tokens=12, **rule).tokens)  # type: ignore[arg-type]  # as above
