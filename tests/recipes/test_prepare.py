"""The prepare command: a folder of text -> llm.c shards that hold exactly that text, split per file."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from lit_dp_recipes.prepare import prepare_shards, summary
from lit_dp_recipes.shards import inspect_shard, tokens
from lit_dp_recipes.token_data import TokenDataModule
from tests.helpers.recipes import ROOT


def write_texts(folder, sizes=(3000, 1000, 5000)):
    rng = np.random.default_rng(0)
    texts = {}
    for index, size in enumerate(sizes):
        path = folder / ("sub" if index == 2 else ".") / f"doc{index}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        texts[path] = bytes(rng.integers(32, 127, size=size, dtype=np.uint8))
        path.write_bytes(texts[path])
    (folder / "notes.md").write_text("not matched by the pattern")
    return [texts[p] for p in sorted(texts, key=str)]


def read_all(paths):
    return b"".join(tokens(inspect_shard(p)).astype(np.uint8).tobytes() for p in paths)


def test_bytes_shards_hold_each_files_text_split_train_then_val(tmp_path):
    texts = write_texts(tmp_path / "in")
    prepared = prepare_shards(str(tmp_path / "in"), str(tmp_path / "out"), shard_tokens=2000, val_fraction=0.1)
    assert (prepared.name, prepared.files, prepared.vocab_size) == ("in", 3, 256)
    # Each file's last tenth validates; the rest trains; files in sorted order.
    assert read_all(prepared.train) == b"".join(t[: len(t) - round(len(t) * 0.1)] for t in texts)
    assert read_all(prepared.val) == b"".join(t[len(t) - round(len(t) * 0.1) :] for t in texts)
    # 8100 training tokens in shards of 2000: three full ones, the rest (2100) joins the last.
    assert [inspect_shard(p).num_tokens for p in prepared.train] == [2000, 2000, 2000, 2100]
    assert [p.rsplit("/", 1)[1] for p in prepared.val] == ["in_val_000000.bin"]
    assert all(inspect_shard(p).format == "llm.c" for p in prepared.train + prepared.val)
    # What the summary tells the user to run trains on exactly these files.
    command = summary(prepared, str(tmp_path / "out")).splitlines()[1]
    options = dict(part.split("=", 1) for part in command.split() if "=" in part)
    data = TokenDataModule(
        options["data.train_shards"].strip("'"), options["data.val_shards"].strip("'"), int(options["data.vocab_size"]),
        block_size=32, batch_size=4,
    )
    assert [s.path for s in data.train_shards] == prepared.train


@pytest.mark.slow  # end to end: the script run as a user runs it
def test_the_script_runs_as_a_user_types_it_from_a_fresh_folder(tmp_path):
    # A fresh process from a fresh working directory, with the run folder Hydra names itself
    # (conf/hydra/default.yaml's lit_dp.job_folder resolver): the documented tests run the
    # commands in one process, where another recipe registered the resolver first (issue 28 #1).
    write_texts(tmp_path / "texts")
    result = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "prepare_shards.py"), "input_dir=texts", "output_dir=shards"],
        cwd=tmp_path, capture_output=True, text=True, timeout=240,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"recipes/prepare_shards.py failed ({result.returncode}):\n{output[-4000:]}"
    assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == ["texts_train_000000.bin", "texts_val_000000.bin"]
    assert list((tmp_path / "outputs" / "prepare_shards").glob("*/prepare_shards.log"))


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"input_dir": "missing"}, r"input_dir='.*missing' is not a folder"),
        ({"pattern": "*.rst"}, r"input_dir='.*' has no file matching pattern='\*.rst'"),
        ({"tokenizer": "sentencepiece"}, r"tokenizer='sentencepiece' is invalid: expected one of bytes, gpt2"),
        ({"val_fraction": 1.0}, r"val_fraction=1.0 is invalid: expected a number in \(0, 1\)"),
        ({"shard_tokens": 0}, r"shard_tokens=0 is invalid"),
    ],
)
def test_bad_prepare_options_are_named(tmp_path, arguments, message):
    write_texts(tmp_path / "in")
    options = {"input_dir": str(tmp_path / "in"), "output_dir": str(tmp_path / "out")} | arguments
    if options["input_dir"] == "missing":
        options["input_dir"] = str(tmp_path / "missing")
    with pytest.raises(ValueError, match=message):
        prepare_shards(**options)


def test_existing_shards_are_not_overwritten(tmp_path):
    write_texts(tmp_path / "in")
    prepare_shards(str(tmp_path / "in"), str(tmp_path / "out"))
    with pytest.raises(ValueError, match=r"output_dir='.*out' already holds shards named 'in' \(in_train_000000.bin"):
        prepare_shards(str(tmp_path / "in"), str(tmp_path / "out"))


def test_gpt2_without_tiktoken_names_the_option_and_the_package(tmp_path, monkeypatch):
    write_texts(tmp_path / "in")
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # `import tiktoken` raises ImportError, installed or not
    with pytest.raises(ValueError, match=r"tokenizer=gpt2 needs tiktoken, which is not installed: pip install tiktoken"):
        prepare_shards(str(tmp_path / "in"), str(tmp_path / "out"), tokenizer="gpt2")
    assert not (tmp_path / "out").exists()  # nothing written
