"""``--model-path DIR`` (issue 37): a local Hugging Face directory's weights and tokenizer in the local engine, the
chat template, --input-key / --label-key, stop tokens, the deepscaler reward, and what the manifest claims."""

from __future__ import annotations

import json

import pytest

from rlk_core.plan import RoutePlan
from rlk_repro import cli
from rlk_repro.engine.local import load_model, run_local
from rlk_repro.engine.prompts import load_prompt_set
from rlk_repro.model.tokenizer import HFTokenizer
from rlk_repro.model.weights import load_checkpoint, weights_sha256
from rlk_repro.prepare import prepare


def test_tokenizer_template_and_stop_tokens(hf_model):
    tok = HFTokenizer(hf_model)
    text = tok.apply_chat_template([{"role": "user", "content": "What is $1+1$?"}])
    assert text == "<|im_start|>user\nWhat is $1+1$?<|im_end|>\n<|im_start|>assistant\n"
    no_think = tok.apply_chat_template([{"role": "user", "content": "x"}], enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids.count(tok._tok.token_to_id("<|im_start|>")) == 2  # specials are single tokens
    eos, eot = tok._tok.token_to_id("<|im_end|>"), tok._tok.token_to_id("<|endoftext|>")
    assert tok.stop_token_ids(eos, [7]) == sorted({eos, eot, 7})


def test_model_path_loads_the_directory_weights(hf_model, small_config):
    cfg = small_config(RoutePlan("R/R", "R/R", "R/R"), model_path=str(hf_model))
    model_cfg, weights, digest = load_model(cfg)
    assert digest == weights_sha256(load_checkpoint(hf_model)[1])
    assert model_cfg.vocab_size == HFTokenizer(hf_model).vocab_size
    other = small_config(RoutePlan("R/R", "R/R", "R/R"))
    assert load_model(other)[2] != digest  # the preset is not what was loaded


def test_prompt_set_uses_template_keys_and_deepscaler(hf_model, dapo_parquet, tmp_path, small_config):
    prepare(tmp_path / "W", source=dapo_parquet, download_data=False, model_path=None, convert=False)
    data = tmp_path / "W" / "data" / "dapo-math-17k.vime.jsonl"
    cfg = small_config(RoutePlan("R/R", "R/R", "R/R"), model_path=str(hf_model), prompt_data=str(data),
                       apply_chat_template=True)
    model_cfg = load_model(cfg)[0]
    ps = load_prompt_set(cfg, model_cfg)
    tok = HFTokenizer(hf_model)
    assert len(ps.prompts) == 5 and ps.prompts[2].answer == "\\frac{7}{2}"
    assert ps.prompts[0].text.startswith("<|im_start|>user\nWhat is $1+1$?")
    assert ps.encoded[0] == tok.encode(ps.prompts[0].text)
    assert ps.rm_type == "deepscaler" and ps.data["purpose"] == "developer-fixture"
    good = "So it is 7/2.</think>The answer is \\boxed{\\frac{7}{2}}<|im_end|>"
    assert ps.reward(tok.encode(good), "\\frac{7}{2}") == 1
    assert ps.reward(tok.encode("</think>\\boxed{3}<|im_end|>"), "\\frac{7}{2}") == 0
    # other keys: a JSONL with question/answer
    alt = tmp_path / "alt.jsonl"
    alt.write_text(json.dumps({"question": "What is 2+2?", "answer": "4"}) + "\n")
    cfg2 = small_config(RoutePlan("R/R", "R/R", "R/R"), model_path=str(hf_model), prompt_data=str(alt),
                        input_key="question", label_key="answer")
    ps2 = load_prompt_set(cfg2, model_cfg)
    assert ps2.prompts[0].text == "What is 2+2?" and ps2.prompts[0].answer == "4" and ps2.data["purpose"] is None
    with pytest.raises(Exception, match="has no 'prompt' / 'label'"):
        load_prompt_set(small_config(RoutePlan("R/R", "R/R", "R/R"), model_path=str(hf_model),
                                     prompt_data=str(alt)), model_cfg)
    with pytest.raises(Exception, match="pass --apply-chat-template"):
        load_prompt_set(small_config(RoutePlan("R/R", "R/R", "R/R"), model_path=str(hf_model),
                                     prompt_data=str(data)), model_cfg)


def test_run_on_a_prepared_workspace_is_exact_and_claims_nothing(hf_model, dapo_parquet, tmp_path, small_config):
    w = tmp_path / "W"
    prepare(w, source=dapo_parquet, download_data=False, model_path=hf_model, convert=True)
    model_dir = w / "models" / hf_model.name
    cfg = small_config(RoutePlan("R/R", "R/R", "R/R"), rounds=2, model_path=str(model_dir),
                       prompt_data=str(w / "data" / "dapo-math-17k.vime.jsonl"), apply_chat_template=True,
                       max_new_tokens=6)
    res = run_local(cfg, tmp_path / "runs")
    assert res.exit_code == 0 and res.bitwise["mismatch_count"] == 0 and res.bitwise["element_count"] > 0
    man = json.loads((res.run_dir / "manifest.json").read_text())
    assert man["claims"]["experiment"] is False
    assert any("developer-fixture" in r for r in man["claims"]["reasons"])
    assert man["model"]["kind"] == "checkpoint" and man["reward"]["rm_type"] == "deepscaler"
    assert man["data"]["purpose"] == "developer-fixture" and man["data"]["rows"] == 5
    from safetensors.torch import load_file

    td = load_file(str(res.run_dir / "train-data" / "round-0000.rank0.safetensors"))
    tok = HFTokenizer(model_dir)
    row, mask = td["token_ids"][0], td["response_mask"][0]
    prompt = [int(x) for x, m in zip(row.tolist(), mask.tolist()) if not m][: len(tok.encode("<|im_start|>user\n"))]
    assert tok.decode(prompt) == "<|im_start|>user\n"  # the chat template's tokens, not bytes


def test_stop_tokens_end_responses(hf_model, tmp_path, small_config):
    vocab = HFTokenizer(hf_model).vocab_size
    cfg = small_config(RoutePlan("R/R", "R/R", "R/R"), rounds=1, model_path=str(hf_model),
                       stop_token_ids=list(range(vocab)))  # every token stops: every response is one token
    res = run_local(cfg, tmp_path)
    row = json.loads((res.run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert row["eos_finished"] == cfg.prompts_per_round * cfg.samples_per_prompt
    preset = run_local(small_config(RoutePlan("R/R", "R/R", "R/R"), rounds=1, model_path=str(hf_model)), tmp_path)
    assert json.loads((preset.run_dir / "metrics.jsonl").read_text().splitlines()[0])["eos_finished"] < \
        row["eos_finished"]


def test_random_weight_run_is_labelled(rr_run):
    man = json.loads((rr_run.run_dir / "manifest.json").read_text())
    assert man["model"]["kind"] == "random-weight preset" and man["claims"]["experiment"] is False
    assert any("random-weight" in r for r in man["claims"]["reasons"])
    assert man["reward"]["rm_type"] == "stand-in"


@pytest.mark.parametrize("args, message", [
    (["--apply-chat-template"], "--apply-chat-template needs --model-path"),
    (["--model-path", "/nonexistent"], "does not exist"),
    (["--prompt-data", "/nonexistent.jsonl"], "no such file"),
    (["--engine", "frameworks", "--prompt-data", "x.jsonl"], "no such file"),  # the frameworks engine takes it too
])
def test_bad_model_options(args, message, tmp_path, capsys):
    assert cli.main(["run", *args, "--output", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err and not any(tmp_path.iterdir())


def test_cli_run_with_workspace(hf_model, dapo_parquet, tmp_path, capsys):
    w = tmp_path / "W"
    assert cli.main(["prepare", "--workspace", str(w), "--source", str(dapo_parquet), "--model-path", str(hf_model),
                     "--convert-checkpoint"]) == 0
    assert "round trip bitwise" in capsys.readouterr().out
    assert cli.main(["run", "--workspace", str(w), "--apply-chat-template", "--rounds", "1", "--prompts-per-round",
                     "1", "--samples-per-prompt", "2", "--max-new-tokens", "4"]) == 0
    runs = list((w / "runs").iterdir())
    assert len(runs) == 1
    man = json.loads((runs[0] / "manifest.json").read_text())
    assert man["config"]["model_path"] == str(w / "models" / hf_model.name)
    assert man["claims"]["experiment"] is False and man["data"]["sha256"].startswith("sha256:")


def test_report_says_what_a_run_may_claim(rr_run, tmp_path):
    from rlk_repro.report import write_report

    summaries, written, *_ = write_report([str(rr_run.run_dir)], str(tmp_path / "rep"))
    assert summaries[0]["claims"].startswith("no experiment or reward claim: random-weight model (preset tiny)")
    md = (tmp_path / "rep" / "metrics-summary.md").read_text()
    assert f"- {summaries[0]['label']}: no experiment or reward claim: random-weight model" in md
