"""scripts/build_default.py: the data split, schedules, log parsing, install, and a tiny run."""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "build_default.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_default", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["build_default"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


bd = _load()


def _tree(root: Path) -> Path:
    files = {
        "os.py": "import sys\n",
        "json/__init__.py": "x = 1\n",
        "json/decoder.py": "y = 2\n",
        "email/mime/text.py": "z = 3\n",
        "test/test_os.py": "assert True\n",
        "idlelib/idle_test/test_x.py": "pass\n",
        "unittest/tests/test_y.py": "pass\n",
        "site-packages/pkg/mod.py": "pass\n",
        "__pycache__/os.cpython.py": "pass\n",
        "README.txt": "not python\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    (root / "latin1.py").write_bytes(b"# caf\xe9\n")
    return root


def test_collect_excludes_and_hashes(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    corpus = bd.collect_corpus(replace(bd.Recipe(), heldout_fraction=0.5), root)
    names = sorted(rel for rel, _ in corpus.train + corpus.heldout)
    assert names == ["email/mime/text.py", "json/__init__.py", "json/decoder.py", "os.py"]
    m = corpus.manifest
    assert m["file_count"] == 4
    assert m["skipped_not_utf8"] == ["latin1.py"]
    assert m["file_list_sha256"] == hashlib.sha256("\n".join(names).encode()).hexdigest()
    assert m["python_version"] == __import__("platform").python_version()
    with_tests = bd.collect_corpus(
        replace(bd.Recipe(), heldout_fraction=0.5, include_tests=True), root
    )
    assert with_tests.manifest["file_count"] == 7
    assert with_tests.manifest["file_list_sha256"] != m["file_list_sha256"]


def test_split_is_by_file_and_deterministic(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    recipe = replace(bd.Recipe(), heldout_fraction=0.5)
    a, b = bd.collect_corpus(recipe, root), bd.collect_corpus(recipe, root)
    assert a == b
    train, held = {r for r, _ in a.train}, {r for r, _ in a.heldout}
    assert not train & held
    assert held == {r for r in train | held if bd.is_heldout(r, 0.5)}
    # the split depends on the path only: editing a file's contents does not move it
    (root / "os.py").write_text("import sys, os\n", encoding="utf-8")
    c = bd.collect_corpus(recipe, root)
    assert {r for r, _ in c.heldout} == held
    assert c.manifest["content_sha256"] != a.manifest["content_sha256"]


def test_split_fraction_on_many_paths() -> None:
    paths = [f"pkg{i}/mod{i}.py" for i in range(4000)]
    share = sum(bd.is_heldout(p, 0.05) for p in paths) / len(paths)
    assert 0.04 < share < 0.06


def test_empty_split_is_an_error(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    with pytest.raises(bd.RecipeError, match="held-out"):
        bd.collect_corpus(replace(bd.Recipe(), heldout_fraction=0.0), root)
    with pytest.raises(bd.RecipeError, match="does not exist"):
        bd.collect_corpus(bd.Recipe(), tmp_path / "nope")


def test_learning_rate_schedule() -> None:
    r = bd.Recipe()
    lrs = [bd.lr_at(s, r, 1.0, 10, 100) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a <= b for a, b in itertools.pairwise(lrs[:10]))  # warm-up rises
    assert all(a >= b for a, b in itertools.pairwise(lrs[9:]))  # cosine falls
    assert bd.lr_at(100, r, 1.0, 10, 100) == pytest.approx(r.min_lr_ratio)
    assert bd.lr_at(150, r, 1.0, 10, 100) == pytest.approx(r.min_lr_ratio)  # stays at the floor


def test_drafter_summary_reads_tau_and_loss() -> None:
    # the layout of train-drafter's train_log.json: [step, loss, accuracy] rows, eval records
    log = {
        "loss": [[1, 5.0, 0.1], [2, 4.0, 0.2]],
        "eval": [
            {"step": 2, "loss": 4.0, "tau": 2.5},
            {"step": 4, "tau": 3.75, "steps": 16.0, "heldout_loss": 4.5},
        ],
        "prompt_lookup_tau": 1.5,
    }
    got = bd.drafter_summary(log)
    assert got["tau"] == 3.75 and got["final_eval"]["steps"] == 16.0
    assert got["prompt_lookup_tau"] == 1.5
    assert [r["loss"] for r in got["loss_curve"]] == [5.0, 4.0]
    many = bd.drafter_summary({"loss": [[i, 1.0 / i, 0.0] for i in range(1, 2002)]})
    assert len(many["loss_curve"]) <= 502 and many["loss_curve"][-1]["step"] == 2001
    assert [r["tau"] for r in got["tau_curve"]] == [2.5, 3.75]
    assert got["heldout_loss_curve"] == [{"step": 4, "heldout_loss": 4.5}]
    # records of the form {step, loss} / {step, tau} anywhere are read too
    other = bd.drafter_summary({"train": [{"step": 1, "loss": 3.0}], "x": {"step": 1, "tau": 2}})
    assert other["tau"] == 2 and other["loss_curve"][0] == {"step": 1, "loss": 3.0}
    assert "tau" not in bd.drafter_summary({"loss": []})


def _fake_train_drafter(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """``subprocess.run`` replaced by a stand-in train-drafter that records its command and
    writes the files the drafter stage copies; returns the recorded commands."""
    calls: list[list[str]] = []

    def run(cmd: list[str], **_: object) -> object:
        calls.append(cmd)
        out = Path(cmd[cmd.index("--out") + 1])
        out.mkdir(parents=True, exist_ok=True)
        for name in (*bd.DRAFTER_FILES, "model.safetensors"):
            (out / name).write_text("{}", encoding="utf-8")
        resumed = [4] if "--resume" in cmd else []
        log = {"loss": [[8, 1.0, 0.5]], "eval": [{"step": 8, "tau": 2.0}], "resumed_at": resumed}
        (out / "train_log.json").write_text(json.dumps(log), encoding="utf-8")
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setattr(bd.subprocess, "run", run)
    return calls


def test_drafter_stage_resumes_from_its_last_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _fake_train_drafter(monkeypatch)
    corpus = bd.collect_corpus(replace(bd.TINY, heldout_fraction=0.5), _tree(tmp_path / "lib"))
    target = Path(bd.PACKAGE_DATA) / "target"  # its tokenizer.json
    work, out = tmp_path / "work", tmp_path / "out"
    ckpt = work / "drafter" / "checkpoints" / "step-000004"

    def stage(resume: bool) -> dict[str, Any]:
        got: dict[str, Any] = bd.run_drafter(
            bd.TINY, target, corpus, work, out, "cpu", resume=resume
        )
        return got

    def checkpoint() -> None:
        ckpt.mkdir(parents=True)
        (ckpt / "trainer_state.json").write_text('{"step": 4}', encoding="utf-8")

    checkpoint()
    got = stage(resume=True)  # a checkpoint: kept, and train-drafter continues from it
    assert calls[-1][-1] == "--resume" and ckpt.is_dir()
    assert got["resumed_at"] == [4]
    assert "--resume" not in got["command"]  # the recorded command is the recipe's own
    assert got["command"][1:] == calls[-1][1:-1]
    stage(resume=False)  # without --resume a stopped run is started afresh
    assert "--resume" not in calls[-1] and not ckpt.exists()
    (ckpt.parent / "step-000008.tmp").mkdir(parents=True)  # an unfinished save only
    stage(resume=True)
    assert "--resume" not in calls[-1]  # nothing to resume from: a fresh start
    with pytest.raises(bd.RecipeError, match="--resume continues the drafter stage"):
        bd.main(["--out", str(tmp_path / "x"), "--resume"])  # no --work
    with pytest.raises(bd.RecipeError, match="--resume continues the drafter stage"):
        bd.main(["--out", str(tmp_path / "x"), "--work", str(work), "--resume", "--skip-drafter"])


def _fake_build(out: Path, weight_bytes: int = 100) -> None:
    for part, names in (("target", bd.TARGET_FILES), ("drafter", bd.DRAFTER_FILES)):
        (out / part).mkdir(parents=True)
        for name in names:
            (out / part / name).write_text("{}", encoding="utf-8")
        (out / part / "model.safetensors").write_bytes(b"\0" * weight_bytes)
    (out / "drafter" / "train_log.json").write_text("{}", encoding="utf-8")
    (out / "summary.json").write_text("{}", encoding="utf-8")


def test_install_copies_the_shipped_files(tmp_path: Path) -> None:
    _fake_build(tmp_path / "out")
    dest = tmp_path / "data" / "default"
    bd.install(tmp_path / "out", dest)
    assert sorted(p.name for p in (dest / "target").iterdir()) == sorted(
        [*bd.TARGET_FILES, "model.safetensors"]
    )
    assert sorted(p.name for p in (dest / "drafter").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]  # no training log
    assert (dest / "build_summary.json").is_file()


def test_install_refuses_oversized_or_incomplete(tmp_path: Path) -> None:
    _fake_build(tmp_path / "big", weight_bytes=13 * 2**20)
    with pytest.raises(bd.RecipeError, match="over the 24 MiB limit"):
        bd.install(tmp_path / "big", tmp_path / "dest")
    _fake_build(tmp_path / "part")
    (tmp_path / "part" / "target" / "tokenizer.json").unlink()
    with pytest.raises(bd.RecipeError, match=r"lacks tokenizer\.json"):
        bd.install(tmp_path / "part", tmp_path / "dest")
    assert not (tmp_path / "dest").exists()  # nothing copied on refusal


def test_bad_arguments() -> None:
    with pytest.raises(bd.RecipeError, match="--steps must be >= 1"):
        bd.recipe_from(bd.parse_args(["--out", "x", "--steps", "0"]))
    with pytest.raises(bd.RecipeError, match="--seed must be >= 0"):
        bd.recipe_from(bd.parse_args(["--out", "x", "--seed", "-1"]))
    assert bd.recipe_from(bd.parse_args(["--out", "x", "--seed", "0"])).seed == 0
    with pytest.raises(bd.RecipeError, match="exclude each other"):
        bd.main(["--out", "x", "--skip-drafter", "--only-drafter"])


def test_set_overrides_recipe_fields() -> None:
    def recipe(*sets: str) -> Any:  # a bd.Recipe: the script is loaded at run time, untyped
        argv = ["--out", "x"]
        for item in sets:
            argv += ["--set", item]
        return bd.recipe_from(bd.parse_args(argv))

    r = recipe("drafter_batch_size=128", "drafter_lr=0.002", "drafter_teacher=data",
               "include_tests=true", "max_files=7")
    assert (r.drafter_batch_size, r.drafter_lr, r.drafter_teacher) == (128, 0.002, "data")
    assert r.include_tests is True and r.max_files == 7
    assert recipe("max_files=none").max_files is None
    assert recipe().drafter_batch_size == bd.Recipe().drafter_batch_size
    # the override reaches the train-drafter command
    cmd = bd.drafter_command(r, Path("t"), Path("a"), Path("b"), Path("o"), "cpu")
    assert cmd[cmd.index("--batch-size") + 1] == "128"
    with pytest.raises(bd.RecipeError, match=r"drafter_batch_sise=1.*FIELD one of"):
        recipe("drafter_batch_sise=1")
    with pytest.raises(bd.RecipeError, match="FIELD=VALUE"):
        recipe("drafter_batch_size")
    with pytest.raises(bd.RecipeError, match=r"drafter_batch_size=1\.5: not an integer"):
        recipe("drafter_batch_size=1.5")
    with pytest.raises(bd.RecipeError, match="include_tests=maybe: not true or false"):
        recipe("include_tests=maybe")
    with pytest.raises(bd.RecipeError, match="drafter_steps=0: must be > 0"):
        recipe("drafter_steps=0")
    with pytest.raises(bd.RecipeError, match=r"--set lr=0\.0: must be > 0"):
        recipe("lr=0.0")
    with pytest.raises(bd.RecipeError, match=r"weight_decay=-0\.1: must be >= 0"):
        recipe("weight_decay=-0.1")
    assert recipe("seed=0", "drafter_save_every=0").drafter_save_every == 0
    with pytest.raises(bd.RecipeError, match="drafter_teacher=gen: drafter_teacher is generate"):
        recipe("drafter_teacher=gen")  # refused before any training, not by train-drafter
    with pytest.raises(bd.RecipeError, match="drafter_steps=none: not an integer"):
        recipe("drafter_steps=none")  # only the optional limits take none


@pytest.mark.slow
def test_tiny_recipe_end_to_end(tmp_path: Path) -> None:
    """The whole target side on CPU: data, tokenizer, a few steps, save, eval, parity."""
    import torch
    import transformers

    from dflash.model import TargetModel
    from dflash.model.tokenizer import eos_token_id, load_tokenizer

    out = tmp_path / "out"
    assert bd.main(["--out", str(out), "--tiny", "--skip-drafter", "--steps", "2"]) == 0
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    assert summary["data"]["file_count"] > 100  # the interpreter's own standard library
    assert summary["target"]["parity"]["max_abs_logit_diff"] <= 1e-3
    assert summary["target"]["heldout_ppl"] > 1.0
    assert summary["tokenizer"]["special_tokens"] == {"<|endoftext|>": 0, "<|mask|>": 511}
    assert (out / "loss_curves.png").stat().st_size > 0
    target = out / "target"
    tok = load_tokenizer(target)
    assert tok is not None and eos_token_id(target) == 0
    text = "def f(x):\n    return x  # ✓\n"
    assert tok.decode(tok.encode(text)) == text
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    ids = torch.tensor([tok.encode(text)])
    ours = TargetModel.from_pretrained(target)
    with torch.inference_mode():
        # train(False) is what eval() runs; transformers leaves eval() unannotated
        ref = hf.train(False)(input_ids=ids, use_cache=False).logits
        got, _ = ours(ids, ours.new_caches(max_len=ids.shape[1]), "prefill")
    assert float((got - ref).abs().max()) <= 1e-3
    sd = hf.state_dict()
    assert all(v.dtype == torch.float32 for v in sd.values())  # loaded as asked...
    from safetensors import safe_open

    with safe_open(str(target / "model.safetensors"), "pt") as f:  # ...from bf16 on disk
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # noqa: SIM118 - no __iter__
    # the tokenizer is a pure function of the train split
    corpus = bd.collect_corpus(bd.TINY)
    retrained = tmp_path / "tok.json"
    bd.train_tokenizer(corpus, bd.TINY).save(str(retrained))
    assert retrained.read_bytes() == (target / "tokenizer.json").read_bytes()
