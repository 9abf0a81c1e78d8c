"""The preflight's data checks, on a sample: the source opens, its format and columns are what the run reads, its first
rows tokenize (or encode as fine-tuning examples), and the run's length in steps and epochs follows from it; a
packed cache or a prepared directory is read instead of the sample where it exists.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from model_utils.config.fine_tuning import steps_for_epochs
from model_utils.config.preference import max_length_of
from model_utils.core.problems import Problem
from model_utils.data.blocks import block_count, held_out_count
from model_utils.data.errors import LOAD_ERRORS, DataError
from model_utils.data.loading import load_problem, load_splits, stream_documents
from model_utils.data.pipeline import DUMMY_VALIDATION_FRACTION, OPENED_WITHOUT_TOKENIZING, describe_without_tokenizing
from model_utils.data.preference.cache import open_pairs, pair_cache_of
from model_utils.data.preference.encode import PairEncoder
from model_utils.data.preference.formats import PREFERENCE, check_pair_rows, is_messages
from model_utils.data.preference.packing import pack_pairs
from model_utils.data.sft.cache import SFTSettings, load_sft_splits, open_sft, sft_cache_dir, sft_cache_root, source_key
from model_utils.data.sft.encode import ExampleEncoder, check_rows, encode_rows
from model_utils.data.sft.formats import FORMATS
from model_utils.data.sft.packing import pack_examples
from model_utils.data.streaming import describe_stream
from model_utils.data.tokens import cache_dir_for, tokenize_split
from model_utils.data.vision.formats import VISION
from model_utils.planning.report import Report
from model_utils.planning.vision import describe_vision_data

if TYPE_CHECKING:  # annotations only
    from model_utils.planning.plan import Plan


SAMPLE_DOCUMENTS = 200


def check_plan_data(plan: Plan, report: Report):
    """The column and tokenization of the plan's data source, on a sample; exact counts from the cache if built."""
    cfg, tokenizer, seq_len, world, micro = plan.cfg, plan.tokenizer, plan.seq_len, plan.world, plan.batch.micro
    source = plan.data_source
    if cfg.data.dummy_data:
        report.lines.append(f"data: dummy, {cfg.data.dummy_data} random blocks")
        blocks = cfg.data.dummy_data - held_out_count(cfg.data.dummy_data, DUMMY_VALIDATION_FRACTION)
    elif source is None:  # not resolved: the plan's problems say why
        return
    elif source.kind == "stream":  # a sample of its first documents; its size is known only once read

        try:
            report.lines.append(describe_stream(cfg.data, source, tokenizer))
        except DataError as e:
            report.problems.append(e.problem)
        return
    elif plan.data_format == VISION:  # rows with images (a vision-language model)
        try:
            line, blocks = describe_vision_data(plan, SAMPLE_CHECKED_ROWS, SAMPLE_DOCUMENTS)
        except DataError as e:
            report.problems.append(e.problem)
            return
        report.lines.append(line)
    elif plan.data_format in FORMATS or plan.data_format == PREFERENCE:  # fine-tuning examples, preference pairs
        try:
            line, blocks = (describe_preference_data if plan.data_format == PREFERENCE
                            else describe_fine_tuning_data)(plan)
        except DataError as e:
            report.problems.append(e.problem)
            return
        report.lines.append(line)
    elif source.kind in OPENED_WITHOUT_TOKENIZING:  # prepared shards, token files, a mixture
        try:
            line, blocks = describe_without_tokenizing(cfg.data, source, tokenizer, seq_len)
        except DataError as e:
            report.problems.append(e.problem)
            return
        report.lines.append(line)
    else:
        try:
            cache = cache_dir_for(cfg.data, source, tokenizer)
            if (cache / "meta.json").exists():
                meta = json.loads((cache / "meta.json").read_text())
                tokens = meta["tokens"]["train"]
                report.lines.append(f"data: {source.location}: {tokens:,} tokens (packed cache {cache})")
                blocks = block_count(tokens, seq_len)
                if "validation" not in meta["tokens"]:
                    blocks -= held_out_count(blocks, cfg.data.validation_fraction)
            else:
                sample, total_docs = _sample(source, cfg)
                tokenized = tokenize_split(sample, tokenizer, cfg.data.text_column, 1, "train (sample)")
                sample_tokens = sum(len(x) for x in tokenized["input_ids"])
                if sample_tokens == 0:
                    raise DataError(Problem("--text_column", cfg.data.text_column, "the sampled documents hold no text",
                                            "check the column's contents"))
                est = sample_tokens * (total_docs / len(sample)) if total_docs else None
                report.lines.append(f"data: {source.location}: column '{cfg.data.text_column}' present; "
                                    f"~{est:,.0f} tokens estimated from {len(sample)} documents" if est else
                                    f"data: {source.location}: column '{cfg.data.text_column}' present (streamed sample)")
                blocks = int(est // seq_len) if est else None
        except DataError as e:
            report.problems.append(e.problem)
            return
    if blocks is not None and cfg.batch.num_epochs is not None and blocks >= world * micro:
        steps = steps_for_epochs(cfg.batch.num_epochs, blocks, world, micro, plan.batch.accumulation)
        report.lines.append(f"epochs: {cfg.batch.num_epochs:g} = ~{steps:,} steps at this batch (settled from the "
                            "packed data when the run starts)")
    if blocks is not None and blocks < world * micro:
        report.problems.append(Problem("--seq_len", plan.sequence_tokens, f"the data gives ~{blocks} training blocks, "
                                       f"fewer than one micro-batch per rank ({micro} x {world} ranks)",
                                       "use more data, a smaller --seq_len or a smaller micro-batch"))


SAMPLE_CHECKED_ROWS = 5000  # rows whose format is checked (cheap: no tokenization)


def describe_fine_tuning_data(plan: Plan) -> tuple[str, int | None]:
    """The data line and training blocks of fine-tuning data: from its packed cache where the run built it, else
    from the first rows: the format checked on SAMPLE_CHECKED_ROWS of each split (a mixed or wrong row is a DataError
    naming the file, the row and its columns) and SAMPLE_DOCUMENTS of them encoded and packed for the estimate."""
    cfg, source, tokenizer = plan.cfg.data, plan.data_source, plan.tokenizer
    settings = SFTSettings(plan.seq_len, plan.data_format, cfg.train_on_prompts, cfg.validation_fraction)
    cache = sft_cache_dir(sft_cache_root(cfg), source_key(source, cfg), tokenizer, settings)
    if (cache / "meta.json").exists():
        data = open_sft(cache, cfg.validation_fraction)
        return f"data: {data.description} (packed cache {cache})", len(data.train_ids)
    train, validation = load_sft_splits(source, cfg)
    for split, rows in (("train", train), ("validation", validation)):
        if rows is not None:
            check_rows(rows.select(range(min(SAMPLE_CHECKED_ROWS, len(rows)))), plan.data_format,
                       f"{source.location} ({split} split)")
    sample = train.select(range(min(SAMPLE_DOCUMENTS, len(train))))
    encoder = ExampleEncoder(tokenizer, plan.data_format, cfg.train_on_prompts, source.location)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stats = pack_examples(encode_rows(sample, encoder, checked=True), plan.seq_len, pad, len(tokenizer)).stats
    blocks = int(stats.blocks * len(train) / max(len(sample), 1))
    if validation is None:
        blocks -= held_out_count(blocks, cfg.validation_fraction)
    return (f"data: {source.location}: fine-tuning data ({encoder.describe()}), {len(train):,} rows; the first "
            f"{len(sample)}: {stats.describe()}; ~{blocks:,} training blocks estimated"), blocks


def describe_preference_data(plan: Plan) -> tuple[str, int | None]:
    """The data line and training blocks of preference pairs: from their packed cache where the run built it, else
    from the first rows, as describe_fine_tuning_data does for examples."""
    cfg, source, tokenizer = plan.cfg.data, plan.data_source, plan.tokenizer
    cache = pair_cache_of(cfg, source, tokenizer, plan.seq_len)
    if (cache / "meta.json").exists():
        data = open_pairs(cache, cfg.validation_fraction)
        return f"data: {data.description} (packed cache {cache})", len(data.train_ids)
    train, validation = load_sft_splits(source, cfg)
    for split, rows in (("train", train), ("validation", validation)):
        if rows is not None:
            check_pair_rows(rows.select(range(min(SAMPLE_CHECKED_ROWS, len(rows)))), f"{source.location} ({split} split)")
    sample = train.select(range(min(SAMPLE_DOCUMENTS, len(train))))
    encoder = PairEncoder(tokenizer, source.location)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stats = pack_pairs((encoder.encode(row, n) for n, row in enumerate(sample, start=1)),
                       max_length_of(plan.seq_len), pad, len(tokenizer)).stats
    blocks = int(stats.blocks * len(train) / max(len(sample), 1))
    if validation is None:
        blocks -= held_out_count(blocks, cfg.validation_fraction)
    return (f"data: {source.location}: {encoder.describe(is_messages(train[0]['chosen']))}, {len(train):,} rows; "
            f"the first {len(sample)}: {stats.describe()}; ~{blocks:,} training blocks estimated"), blocks


def _sample(source, cfg):
    import datasets

    if source.kind == "hub":
        try:
            wanted = min(SAMPLE_DOCUMENTS, cfg.data.max_documents or SAMPLE_DOCUMENTS)
            rows = list(stream_documents(source.location, cfg.data.dataset_config_name, None, "train", wanted))
        except LOAD_ERRORS as e:
            raise load_problem(source, e) from e
        if not rows:
            raise DataError(Problem("--dataset", source.location, "is empty", "point --dataset at data with documents"))
        # The document count is known when the sample holds them all, or when --max_documents caps it.
        return datasets.Dataset.from_list(rows), len(rows) if len(rows) < wanted else (cfg.data.max_documents or None)
    train, _ = load_splits(source, cfg.data)
    if len(train) == 0:
        raise DataError(Problem("--dataset", source.location, "is empty", "point --dataset at data with documents"))
    return train.select(range(min(SAMPLE_DOCUMENTS, len(train)))), len(train)
