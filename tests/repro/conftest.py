"""Shared fixtures of the local-engine tests: small configs and session-scoped runs (each run once)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlk_core.plan import RoutePlan
from rlk_repro.engine.local import LocalRunConfig, run_local

ROUNDS = 5


def small_config(plan: RoutePlan, rounds: int = ROUNDS, **kw) -> LocalRunConfig:
    """Tiny model, 2 prompts x 3 samples, 8 new tokens; chunk 12 and page 4, so most prompts are chunked."""
    base = dict(plan=plan, rounds=rounds, seed=7, model="tiny", prompts_per_round=2, samples_per_prompt=3,
                max_new_tokens=8, chunk_size=12, page_size=4, max_num_seqs=4, lr=3e-3, top_p=1.0,
                threads=1, command=["pytest", "tests/repro"])
    base.update(kw)
    return LocalRunConfig(**base)


@pytest.fixture(name="small_config", scope="session")
def _small_config():
    return small_config


@pytest.fixture(scope="session")
def rr_run(tmp_path_factory):
    return run_local(small_config(RoutePlan("R/R", "R/R", "R/R")), tmp_path_factory.mktemp("rr"))


@pytest.fixture(scope="session")
def pp_run(tmp_path_factory):
    return run_local(small_config(RoutePlan("P/P", "P/P", "P/P")), tmp_path_factory.mktemp("pp"))


# -- a DAPO-Math-17k-shaped Parquet fixture (issue 37) ---------------------------------------------------------------
# The official file's schema: data_source, prompt as a chat list of {content, role}, ability, reward_model
# {ground_truth, style}, extra_info {index: string}; each problem is repeated, as the official file repeats them.

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
PROBLEMS = [  # (question, ground truth)
    ("What is $1+1$?", "2"),
    ("Compute $\\frac{3}{4} + \\frac{1}{4}$.", "1"),
    ("Solve $2x = 7$ for $x$.", "\\frac{7}{2}"),
    ("What is $12 \\times 12$?", "144"),
    ("How many degrees are in a right angle?", "90"),
]


def dapo_rows(repeats: int = 3) -> list[dict]:
    out = []
    for _ in range(repeats):
        for i, (q, a) in enumerate(PROBLEMS):
            out.append({
                "data_source": "math_dapo",
                "prompt": [{"content": f"{q}\n\n{INSTRUCTION}", "role": "user"}],
                "ability": "MATH",
                "reward_model": {"ground_truth": a, "style": "rule-lighteval/MATH_v2"},
                "extra_info": {"index": f"{i:08x}-dapo"},
            })
    return out


def write_dapo_parquet(path: Path, table_rows: list[dict] | None = None) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
        ("extra_info", pa.struct([("index", pa.string())])),
    ])
    pq.write_table(pa.Table.from_pylist(dapo_rows() if table_rows is None else table_rows, schema=schema), path)
    return path


@pytest.fixture(name="dapo_parquet")
def _dapo_parquet(tmp_path):
    pytest.importorskip("pyarrow", reason="the Parquet fixture needs pyarrow (rlk-repro[prepare])")
    return write_dapo_parquet(tmp_path / "dapo-math-17k.parquet")


@pytest.fixture(name="make_dapo_parquet")
def _make_dapo_parquet():
    """``write_dapo_parquet(path, rows)``, and ``dapo_rows`` to build rows from."""
    pytest.importorskip("pyarrow", reason="the Parquet fixture needs pyarrow (rlk-repro[prepare])")
    return write_dapo_parquet, dapo_rows


# -- a local Hugging Face model directory (issue 37): a small BPE tokenizer with a chat template, random weights ----
def write_hf_model(path: Path, seed: int = 3) -> Path:
    """A tokenizer trained here (byte-level BPE on the fixture's problems, saved as tokenizer.json with a ChatML
    template in tokenizer_config.json: rlk_repro.model.tokenizer_build) and a random tiny Qwen3 checkpoint over its
    vocabulary."""
    from rlk_repro.model.config import PRESETS
    from rlk_repro.model.tokenizer_build import train_bpe, write_tokenizer
    from rlk_repro.model.weights import random_weights, save_checkpoint

    corpus = [q + " " + a + " " + INSTRUCTION for q, a in PROBLEMS] * 4 + ["\\boxed{42} </think> 0123456789"]
    tok = train_bpe(corpus, 400)
    ids = write_tokenizer(path, tok)
    cfg = PRESETS["tiny"].with_overrides(vocab_size=tok.get_vocab_size(), bos_token_id=None, eos_token_id=ids["eos"])
    save_checkpoint(path, cfg, random_weights(cfg, seed))
    return path


@pytest.fixture(name="hf_model", scope="session")
def _hf_model(tmp_path_factory):
    pytest.importorskip("tokenizers", reason="the model fixture trains its tokenizer with tokenizers "
                        "(rlk-repro[tokenizer])")
    return write_hf_model(tmp_path_factory.mktemp("hf") / "tiny-qwen3")
