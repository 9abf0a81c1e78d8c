"""benchmarks/vlm_bench.py's and vlm_peer.py's own parts on CPU: the rows both sides read, the runs of an invocation
and our flags, TRL's counted micro-batches (positions, images, the tower's FLOPs), and the FLOPs beyond the language
model in the figures."""

from __future__ import annotations

import json
import sys
from argparse import Namespace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))


def vlm_args(**overrides) -> Namespace:
    values = dict(micro_batch_size=[1, 2], peer_micro_batch_size=[4, 8], nproc=1, seq_len=4096, modes=["full", "lora"],
                  skip=[], steps=20, warmup=2, seed=5, ds_config="ds_config.json", zero_stage=None, ds_set=[],
                  gradient_checkpointing=True, lora_rank=16, lora_alpha=32.0, lora_target_modules=None,
                  peer_liger="on", peer_attn="auto", attention_kernel="auto", freeze="vision_tower",
                  workdir="/work")
    return Namespace(**{**values, **overrides})


def test_jobs_give_ours_blocks_and_trl_the_examples_they_hold():
    """Ours: the global batch in blocks of seq_len; TRL: as many examples per step as those block tokens hold at the
    rows' mean length (16,384 / 400 = 41 examples: 10 micro-batches of 4, 5 of 8)."""
    import vlm_bench

    jobs = vlm_bench.make_jobs(vlm_args(), Path("/m"), Path("/rows/train.jsonl"), 16384, 400.0, 802816)
    assert [j["name"] for j in jobs] == [
        "ours-full-mb1-ga4", "ours-full-mb2-ga2", "trl-full-mb4-ga10", "trl-full-mb8-ga5",
        "ours-lora-mb1-ga4", "ours-lora-mb2-ga2", "trl-lora-mb4-ga10", "trl-lora-mb8-ga5"]
    assert all(("peer_accumulation" in j) == (j["side"] == "trl") for j in jobs)
    assert {(j["freeze"], j["max_image_pixels"], j["data_cache"]) for j in jobs} == {
        ("vision_tower", 802816, "/work/data-cache")}
    only_trl = vlm_bench.make_jobs(vlm_args(skip=["ours"], modes=["lora"]), Path("/m"), Path("/r"), 16384, 400.0, None)
    assert [j["name"] for j in only_trl] == ["trl-lora-mb4-ga10", "trl-lora-mb8-ga5"]


def test_our_flags_name_the_model_rows_frozen_parts_and_pixel_bound(tmp_path):
    import vlm_bench
    import vlm_peer

    lora = next(j for j in vlm_bench.make_jobs(vlm_args(), Path("/m"), Path("/r.jsonl"), 16384, 400.0, 50176)
                if j["mode"] == "lora" and j["side"] == "ours")
    argv = vlm_peer.vlm_argv(lora, tmp_path)
    assert argv[:6] == ["--model", "/m", "--dataset", "/r.jsonl", "--freeze", "vision_tower"]
    flag = {name: argv[argv.index(name) + 1] for name in ("--max_image_pixels", "--lora_rank", "--validation_fraction",
                                                         "--global_batch_tokens", "--micro_batch_size")}
    assert flag == {"--max_image_pixels": "50176", "--lora_rank": "16", "--validation_fraction": "0",
                    "--global_batch_tokens": "16384", "--micro_batch_size": "1"}
    assert "--gradient_checkpointing" in argv and "--data_format" not in argv  # the layout from the columns
    assert "--max_image_pixels" not in vlm_peer.vlm_argv(dict(lora, max_image_pixels=None), tmp_path)


def test_trl_micro_batches_count_positions_images_and_the_towers_flops():
    """Two timed micro-batches of padded rows: 2 x 10 positions holding two images (grids of 16 and 32 patches, 4
    and 8 tokens merged 2 x 2) and 2 padding, then 1 x 4 without an image; the warm-up's micro-batch is not counted."""
    import torch
    import vlm_peer

    from model_utils.models.vision.flops import VisionFlops

    timer = Namespace(times=[])
    counter = vlm_peer.VisionCounter(timer, warmup=1, image_token_id=9)
    model = torch.nn.Module()
    counter(model, (), {"input_ids": torch.tensor([[9, 1]]), "attention_mask": torch.ones(1, 2, dtype=torch.long)})
    timer.times.append(1.0)
    ids = torch.tensor([[9] * 4 + [1, 2, 3, 4, 0, 0], [9] * 8 + [5, 6]])
    counter(model, (), {"input_ids": ids, "attention_mask": torch.tensor([[1] * 8 + [0, 0], [1] * 10]),
                        "image_grid_thw": torch.tensor([[1, 4, 4], [1, 4, 8]]), "labels": ids})
    counter(model, (), {"input_ids": torch.tensor([[3, 4, 5, 6]]), "attention_mask": torch.ones(1, 4, dtype=torch.long),
                        "labels": torch.tensor([[3, 4, 5, 6]])})
    flops = VisionFlops(tower_params=100, projector_params=10, tower_layers=2, tower_hidden=8, tower_trains=False,
                        projector_trains=True)
    positions, images, image_tokens, total = counter.vision_totals(flops)
    assert (positions, images, image_tokens) == (24, 2, 12)
    # a frozen tower: 2N per patch and 4 per query-key pair, layer and channel; a trained projector 6N per token
    assert total == flops.flops([16, 32], 12) == 2 * 100 * 48 + 4 * 2 * 8 * (16 ** 2 + 32 ** 2) + 6 * 10 * 12
    tokens, _, _ = counter.totals("none")
    assert tokens == 8 + 10 + 4  # the attention masks' tokens, padding left out
    fields = vlm_peer.vision_fields(positions, tokens, images, image_tokens, steps=1, world=1)
    assert fields["padding_share"] == pytest.approx(2 / 24) and fields["images_per_step_per_gpu"] == 2


def test_the_towers_flops_add_to_the_language_models_in_the_figures():
    import fine_tuning_work
    from transformers import Qwen2Config

    config = Qwen2Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    plain = fine_tuning_work.figures(config, 200_000, 256, 2000, 40_000, 500, [1.0, 1.0], 1)
    more = fine_tuning_work.figures(config, 200_000, 256, 2000, 40_000, 500, [1.0, 1.0], 1, extra_flops=4e12)
    assert "extra_tflops_per_gpu" not in plain and more["extra_tflops_per_gpu"] == pytest.approx(2.0)
    assert more["tflops_per_gpu"] == pytest.approx(plain["tflops_per_gpu"] + 2.0)
    assert more["tflops_per_gpu_6"] == pytest.approx(plain["tflops_per_gpu_6"] + 2.0)
    assert more["tokens_per_s_per_gpu"] == plain["tokens_per_s_per_gpu"]


def test_rows_are_seeded_image_chats_of_mixed_sizes_written_once(tmp_path):
    """40 rows: about one in ten without an image, pictures of sizes in multiples of 28 within 224x224 and 672x448,
    answers of 20 to seq_len / 2 tokens; the same seed writes the same rows, and a second call rewrites nothing."""
    from PIL import Image
    import vlm_bench

    from model_utils.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(None)
    rows_file = vlm_bench.write_rows(tmp_path / "rows", 40, 7, tokenizer, 256)
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    assert len(rows) == 40 and 1 <= sum(not row["images"] for row in rows) <= 8
    for row in rows:
        roles = [m["role"] for m in row["messages"]]
        assert roles == ["system", "user", "assistant"]
        assert [part["type"] for part in row["messages"][1]["content"]] == ["image"] * len(row["images"]) + ["text"]
        answer = row["messages"][2]["content"][0]["text"]
        assert 20 <= len(tokenizer(answer, add_special_tokens=False)["input_ids"]) <= 128 + 1, answer
        for image in row["images"]:
            with Image.open(rows_file.parent / image) as opened:
                width, height = opened.size
            assert width % 28 == height % 28 == 0 and 224 <= width <= 672 and 224 <= height <= 448
    written = rows_file.stat().st_mtime_ns
    assert vlm_bench.write_rows(tmp_path / "rows", 40, 7, tokenizer, 256).stat().st_mtime_ns == written
    again = vlm_bench.write_rows(tmp_path / "again", 40, 7, tokenizer, 256)
    assert again.read_text() == rows_file.read_text()
