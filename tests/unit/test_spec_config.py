"""--speculative-config parsing and refusals, the drafter's adaptive back-off, and the spec_decode metrics."""
from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import pytest
import torch

from vllmpy.config import EngineConfig
from vllmpy.engine.kv_cache_spec import FullAttentionSpec, KVCacheLayout
from vllmpy.entrypoints.engine_args import add_engine_args, engine_config_from_args
from vllmpy.spec_decode.config import SpeculativeConfig
from vllmpy.spec_decode.drafter import FIRST_PAUSE, Drafter, SpecDecodeStats, build_drafter


def parse(value):
    return SpeculativeConfig.parse(value)


def test_vllm_defaults():
    ngram = parse({"method": "ngram", "num_speculative_tokens": 3})
    assert (ngram.prompt_lookup_min, ngram.prompt_lookup_max) == (5, 5)
    assert parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}).prompt_lookup_min == 4
    assert parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}).prompt_lookup_max == 2
    assert parse({"model": "[ngram]", "num_speculative_tokens": 2}).method == "ngram"
    suffix = parse('{"method": "suffix"}')
    assert suffix.num_speculative_tokens == suffix.suffix_decoding_max_tree_depth == 24
    assert parse({"method": "suffix", "suffix_decoding_max_tree_depth": 8}).num_speculative_tokens == 8
    assert parse(None) is None and parse(suffix) is suffix


@pytest.mark.parametrize("value, message", [
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown key 'lookahead'"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be >= 1, got 0"),
    ({"method": "ngram", "num_speculative_tokens": "4"}, "num_speculative_tokens must be an integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_max (2) must be >= prompt_lookup_min (4)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min must be >= 1"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5}, "suffix_decoding_min_token_prob must be in [0, 1]"),
    ({"method": "suffix", "suffix_decoding_max_spec_factor": 0}, "suffix_decoding_max_spec_factor must be > 0"),
    ({"method": "suffix", "disable_by_batch_size": 0}, "disable_by_batch_size must be >= 1"),
    ({"method": "suffix", "draft_sample_method": "probabilistic"}, "draft_sample_method must be 'greedy'"),
    ({"method": "lookahead"}, "method must be one of ngram, suffix"),
    ({"method": "mtp"}, "num_speculative_tokens is required for method 'mtp'"),
    ({"method": "eagle3", "model": "x"}, "'eagle3' needs a model with EAGLE heads; none is supported yet"),
    ({"method": "eagle", "model": "x"}, "'eagle' needs a model with EAGLE heads"),
    ({"method": "medusa", "model": "x"}, "'medusa' needs a model with Medusa heads"),
    ({"model": "/path/draft.gguf", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2},
     "draft_tensor_parallel_size must be 1"),
    ({"model": "/path/draft.gguf"}, "num_speculative_tokens is required for method 'draft_model'"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "method 'draft_model' needs 'model'"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
])
def test_refusals_name_the_key(value, message):
    with pytest.raises(ValueError) as info:
        parse(value)
    assert message in str(info.value) and "--speculative-config" in str(info.value)


def test_the_flag_and_llm_kwarg_reach_the_engine_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    flag = json.dumps({"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4})
    config = engine_config_from_args(parser.parse_args(["--speculative-config", flag]))
    assert config.model.speculative_config == parse(flag)
    assert EngineConfig.from_kwargs(speculative_config={"method": "suffix"}).model.speculative_config.method == "suffix"
    with pytest.raises(ValueError, match="unknown key 'foo'"):
        engine_config_from_args(parser.parse_args(["--speculative-config", '{"foo": 1}']))


def test_cli_refuses_a_bad_config_before_loading(capsys):
    from vllmpy.entrypoints.cli import main

    assert main(["--prompt", "hi", "--speculative-config", '{"method": "eagle3"}']) == 2
    assert "needs a model with EAGLE heads" in capsys.readouterr().err


def test_engines_that_cannot_roll_back_are_refused():
    config = parse({"method": "ngram", "num_speculative_tokens": 2})
    full = KVCacheLayout.from_specs([FullAttentionSpec(16, 1, 8, torch.float32)], 64)
    with pytest.raises(ValueError, match="task is 'embed'"):
        build_drafter(config, full, "embed")
    # recurrent layers roll back: the runner commits the state at the last accepted draft
    assert build_drafter(config, SimpleNamespace(recurrent=((0, object()),), groups=()), "generate") is not None

    class LatentSpec:  # a kind the verifier has not been checked on
        pass

    with pytest.raises(ValueError, match="KV cache kind LatentSpec is not verified under speculation"):
        build_drafter(config, SimpleNamespace(recurrent=(), groups=(SimpleNamespace(spec=LatentSpec()),)), "generate")
    assert build_drafter(None, full, "generate") is None


class Always:
    def propose(self, req_id, token_ids, num_prompt_tokens, k):
        return [1] * (k + 3)  # more than asked: the drafter cuts

    def on_request_finished(self, req_id, token_ids, num_prompt_tokens):
        pass


def test_low_acceptance_pauses_drafting_longer_each_time():
    drafter = Drafter(parse({"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 3}), Always())
    assert drafter.enabled_for(3) and not drafter.enabled_for(4)
    assert drafter.propose("r", [5, 6], 1, max_drafts=2) == [1, 1]
    assert drafter.propose("r", [5, 6], 1, max_drafts=9) == [1] * 4
    drafter.record("r", 4, 4)
    pauses = []
    for _ in range(3):  # nothing accepted: the average falls under LOW_ACCEPTANCE and drafting pauses
        while drafter.propose("r", [5, 6], 1, 4):
            drafter.record("r", 4, 0)
        pause = 0
        while not drafter.propose("r", [5, 6], 1, 4):
            pause += 1
        pauses.append(pause)
    assert pauses[0] >= FIRST_PAUSE - 1 and pauses[1] > pauses[0] and pauses[2] > pauses[1]
    assert drafter.propose("other", [5], 1, 4) == [1] * 4  # per request
    stats = drafter.stats
    assert stats.num_accepted_tokens == 4 and stats.accepted_per_pos == [1, 1, 1, 1]
    assert stats.mean_acceptance_length == 1 + 4 / stats.num_drafts


def test_metrics_have_vllm_names():
    from vllmpy.engine.llm_engine import EngineStats
    from vllmpy.metrics import ServerMetrics

    spec = SpecDecodeStats(num_drafts=3, num_draft_tokens=9, num_accepted_tokens=5, accepted_per_pos=[3, 2, 0])
    stats = EngineStats(num_running=1, num_waiting=0, kv_cache_usage=0.1, prefix_cache_queries=0, prefix_cache_hits=0,
                        num_preemptions=0, prompt_tokens_total=4, generation_tokens_total=8, spec_decode=spec)
    text = ServerMetrics(lambda: stats, "m").render().decode()
    for line in ('vllm:spec_decode_num_drafts_total{model_name="m"} 3.0',
                 'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 9.0',
                 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 5.0',
                 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 2.0'):
        assert line in text, line


def test_bench_reports_the_config_and_acceptance(tiny_llama_dir, tmp_path, capsys):
    from vllmpy.entrypoints.bench import main

    dataset = tmp_path / "repeat.jsonl"  # a prompt whose last tokens occurred before: n-gram lookup drafts
    dataset.write_text(json.dumps({"prompt_token_ids": [5, 6, 7, 8] * 4}) + "\n")
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 2}'
    assert main(["throughput", "--model", tiny_llama_dir, "--num-prompts", "1", "--dataset-path", str(dataset),
                 "--output-len", "16", "--max-model-len", "64", "--speculative-config", spec]) == 0
    report = capsys.readouterr().out
    assert "Speculative decoding:" in report and "ngram, k=4, prompt_lookup 1..2" in report
    lines = dict(line.split(":", 1) for line in report.splitlines() if line.startswith("spec_"))
    drafted = int(lines["spec_num_draft_tokens"])
    assert drafted > 0 and 0 <= float(lines["spec_acceptance_rate"]) <= 1
    assert float(lines["spec_mean_acceptance_length"]) >= 1
