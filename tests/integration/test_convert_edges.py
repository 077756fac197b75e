"""``convert --to specforge`` tried as a user would break it: DST inside SRC, a DST holding
another dataset's records, one SRC of files of two dumps, hostile metadata. Files are
written here with safetensors (values from token id, position, slot and channel, never
from the code under test); records are read back with ``torch.load``, as SpecForge's
``OfflineEagle3Dataset`` reads them."""

from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")
from safetensors.torch import save_file  # noqa: E402

from sglang_ext import format as fmt  # noqa: E402
from sglang_ext.__main__ import main  # noqa: E402

from test_client_edges import small_fs_fixture  # noqa: E402

NUM_LAYERS = 5


def reference(ids, slots=3, hidden=8):
    """[T, slots, hidden] bf16: id + t/4 + slot*2 + channel/8 (exact in bf16 for small ids)."""
    t = torch.arange(len(ids), dtype=torch.float32)[:, None, None]
    s = torch.arange(slots, dtype=torch.float32)[None, :, None]
    h = torch.arange(hidden, dtype=torch.float32)[None, None, :]
    base = torch.tensor(ids, dtype=torch.float32)[:, None, None]
    return (base + t / 4 + s * 2 + h / 8).to(torch.bfloat16)


def dump(path, ids, layer_ids=(2, 4, 5), hidden=8, dtype=torch.bfloat16, **meta):
    metadata = {**fmt.build_metadata(rid="r", layer_ids=list(layer_ids), num_layers=NUM_LAYERS),
                **meta}
    save_file({"hidden_states": reference(ids, len(layer_ids), hidden).to(dtype),
               "token_ids": torch.tensor(ids, dtype=torch.int64)}, str(path), metadata=metadata)


def convert(src, dst, *extra):
    return main(["convert", "--to", "specforge", str(src), str(dst), "--no-final-norm",
                 *map(str, extra)])


def record(dst, i):
    return torch.load(os.path.join(dst, "rows_0-5000", f"data_{i}.ckpt"), weights_only=True)


def error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err, "no error printed"
    assert "Traceback" not in "\n".join(err)
    return err[-1]


@pytest.fixture
def src(tmp_path):
    src = tmp_path / "hs"
    src.mkdir()
    for i in range(3):
        dump(src / f"hs_{i}.safetensors", [10 + i, 20, 30])
    return src


# ---- DST that is SRC or inside it ---------------------------------------------------------------
@pytest.mark.parametrize("where", ["same", "inside", "inside_via_symlink"])
def test_a_dst_that_is_src_or_inside_it_is_refused_and_nothing_written(src, tmp_path, capsys, where):
    before = sorted(os.listdir(src))
    if where == "same":
        dst = src
    elif where == "inside":
        dst = src / "specforge"
    else:
        os.symlink(src, tmp_path / "link")
        dst = tmp_path / "link" / "sf"
    assert convert(src, dst) == 2
    assert error_line(capsys) == (
        f"error: DST {dst} is extract's --out SRC {src} or a folder inside it: its records "
        f"would mix with the hs_<i> files; pass a DST outside SRC")
    assert sorted(os.listdir(src)) == before


def test_a_dst_beside_src_with_a_shared_prefix_is_taken(src, tmp_path):
    assert convert(src, str(src) + "-specforge") == 0  # hs-specforge is not inside hs
    assert record(str(src) + "-specforge", 2)["input_ids"].tolist() == [12, 20, 30]


# ---- a DST holding other records ----------------------------------------------------------------
def test_a_dst_holding_another_prompts_record_is_refused_before_writing(src, tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    dump(other / "hs_1.safetensors", [7, 8, 9, 6])
    dst = tmp_path / "sf"
    assert convert(other, dst) == 0
    kept = (dst / "rows_0-5000" / "data_1.ckpt").read_bytes()
    capsys.readouterr()
    assert convert(src, dst) == 2
    assert error_line(capsys) == (
        f"error: DST {dst} already holds {dst / 'rows_0-5000' / 'data_1.ckpt'}, whose input_ids "
        f"are not hs_1.safetensors' token_ids (another dataset's record): pass another DST, or "
        f"delete that record to convert it again")
    assert sorted(os.listdir(dst / "rows_0-5000")) == ["data_1.ckpt"]  # nothing written
    assert (dst / "rows_0-5000" / "data_1.ckpt").read_bytes() == kept


def test_a_dst_holding_this_srcs_records_resumes(src, tmp_path, capsys):
    dst = tmp_path / "sf"
    assert convert(src, dst) == 0
    os.unlink(dst / "rows_0-5000" / "data_0.ckpt")
    capsys.readouterr()
    assert convert(src, dst) == 0
    assert json.loads(capsys.readouterr().out)["skipped_existing"] == 2
    assert record(dst, 0)["input_ids"].tolist() == [10, 20, 30]


@pytest.mark.parametrize("planted", ["bytes", "fifo"])
def test_a_dst_record_that_is_not_readable_is_named(src, tmp_path, capsys, planted):
    dst = tmp_path / "sf"
    (dst / "rows_0-5000").mkdir(parents=True)
    if planted == "fifo":  # never opened: the run cannot hang on it
        os.mkfifo(dst / "rows_0-5000" / "data_2.ckpt")
    else:
        (dst / "rows_0-5000" / "data_2.ckpt").write_bytes(b"not a torch.save file")
    assert convert(src, dst) == 2
    line = error_line(capsys)
    assert line.startswith(f"error: DST {dst} already holds {dst / 'rows_0-5000' / 'data_2.ckpt'}, "
                           f"which is not a record torch.load reads ("), line
    assert line.endswith("): pass another DST, or delete that record to convert it again"), line
    assert sorted(os.listdir(dst / "rows_0-5000")) == ["data_2.ckpt"]


# ---- files of two dumps in one SRC --------------------------------------------------------------
@pytest.mark.parametrize("odd", ["layer_ids", "hidden", "dtype"])
def test_files_of_two_dumps_in_one_src_are_refused_before_writing(src, tmp_path, capsys, odd):
    kw = {"layer_ids": dict(layer_ids=(1, 3, 5)), "hidden": dict(hidden=16),
          "dtype": dict(dtype=torch.float16)}[odd]
    dump(src / "hs_2.safetensors", [12, 20, 30], **kw)
    dst = tmp_path / "sf"
    assert convert(src, dst) == 2
    want = {"layer_ids": "layer ids [1, 3, 5], hs_0.safetensors [2, 4, 5]",
            "hidden": "hidden size 16, hs_0.safetensors 8",
            "dtype": "dtype float16, hs_0.safetensors bfloat16"}[odd]
    assert error_line(capsys) == (
        f"error: hs_2.safetensors has {want}: SRC holds files of two dumps, whose records one "
        f"drafter cannot train on together; convert each dump's files into its own DST")
    assert not dst.exists()


def test_fp8_and_bf16_files_of_one_layer_set_convert_together(src, tmp_path):
    from sglang_ext import quant

    ids = [12, 20, 30]
    ref = reference(ids).float()
    q, scales = quant.quantize_fp8(ref.reshape(len(ids), -1), 3)
    meta = {**fmt.build_metadata(rid="r", layer_ids=[2, 4, 5], num_layers=NUM_LAYERS),
            **fmt.dtype_metadata(fmt.FP8)}
    save_file({"hidden_states": q.reshape(ref.shape), "hidden_states_scales": scales[..., None],
               "token_ids": torch.tensor(ids)}, str(src / "hs_2.safetensors"), metadata=meta)
    assert convert(src, tmp_path / "sf") == 0  # both give bf16 records
    assert record(tmp_path / "sf", 2)["hidden_state"].dtype == torch.bfloat16
    assert record(tmp_path / "sf", 0)["hidden_state"].dtype == torch.bfloat16


# ---- hostile metadata ---------------------------------------------------------------------------
def test_a_num_layers_that_is_not_a_number_is_one_sentence(tmp_path, capsys):
    src = tmp_path / "hs"
    src.mkdir()
    dump(src / "hs_0.safetensors", [1, 2, 3], num_layers="five")
    assert convert(src, tmp_path / "sf") == 1
    assert error_line(capsys) == (
        f"error: {src / 'hs_0.safetensors'}: metadata num_layers 'five' is not a layer count; "
        f"run extract again with the same --out to replace it")


def test_a_megabyte_of_layer_ids_is_not_echoed_whole(tmp_path, capsys):
    src = tmp_path / "hs"
    src.mkdir()
    meta = fmt.build_metadata(rid="r", layer_ids=[2, 4, 5], num_layers=NUM_LAYERS)
    meta["layer_ids"] = "[" + "7, " * 400_000 + "7]"  # 1.2 MB
    save_file({"hidden_states": reference([1, 2, 3]), "token_ids": torch.tensor([1, 2, 3])},
              str(src / "hs_0.safetensors"), metadata=meta)
    assert convert(src, tmp_path / "sf") == 1
    line = error_line(capsys)
    assert len(line) < 600, len(line)
    assert f"{src / 'hs_0.safetensors'}: metadata layer_ids '[7, 7, 7, " in line
    assert "is not a sorted list of 3 distinct layer ids" in line


def test_layer_ids_of_json_booleans_are_refused(tmp_path, capsys):
    src = tmp_path / "hs"
    src.mkdir()
    meta = fmt.build_metadata(rid="r", layer_ids=[2, 4, 5], num_layers=NUM_LAYERS)
    meta["layer_ids"] = "[false, true, 5]"  # Python's bools are ints: sorted, distinct, 3
    save_file({"hidden_states": reference([1, 2, 3]), "token_ids": torch.tensor([1, 2, 3])},
              str(src / "hs_0.safetensors"), metadata=meta)
    assert convert(src, tmp_path / "sf") == 1
    assert error_line(capsys) == (
        f"error: {src / 'hs_0.safetensors'}: metadata layer_ids '[false, true, 5]' is not a sorted "
        f"list of 3 distinct layer ids (one per slot); run extract again with the same --out to "
        f"replace it")


# ---- a DST that fills up ------------------------------------------------------------------------
small_fs = small_fs_fixture("64k")


def test_a_full_dst_is_one_sentence_naming_the_record_and_leaves_no_partial_file(
        tmp_path, small_fs, capsys):
    src = tmp_path / "hs"
    src.mkdir()
    dump(src / "hs_0.safetensors", [1, 2, 3])  # a small record: fits
    dump(src / "hs_1.safetensors", list(range(1, 1501)))  # 1500 x 3 x 8 bf16: 70 KiB
    dst = small_fs / "sf"
    assert convert(src, dst) == 1
    record_path = dst / "rows_0-5000" / "data_1.ckpt"
    assert error_line(capsys) == (
        f"error: DST {dst}: cannot write {record_path} (No space left on device); free space "
        f"there, or pass another DST, and run again: the records written are kept")
    assert sorted(os.listdir(dst / "rows_0-5000")) == ["data_0.ckpt"]  # no temporary name left
    assert record(dst, 0)["input_ids"].tolist() == [1, 2, 3]


# ---- names extract never writes -----------------------------------------------------------------
def test_names_extract_never_writes_are_not_taken_for_hs_files(src, tmp_path, capsys):
    """hs_01 (a leading zero) and hs_٣ (an Arabic-Indic digit, which Python's \\d and int()
    take) are not row files: before, each was read as hs_1 / hs_3, a file named wrongly or
    missing ("[Errno 2] No such file or directory", exit 1)."""
    os.rename(src / "hs_1.safetensors", src / "hs_01.safetensors")
    os.rename(src / "hs_2.safetensors", src / "hs_\u0663.safetensors")
    assert convert(src, tmp_path / "sf") == 0
    assert sorted(os.listdir(tmp_path / "sf" / "rows_0-5000")) == ["data_0.ckpt"]
    assert record(tmp_path / "sf", 0)["input_ids"].tolist() == [10, 20, 30]


def test_a_megabyte_num_prompt_tokens_is_not_echoed_whole(tmp_path, capsys):
    src = tmp_path / "hs"
    src.mkdir()
    dump(src / "hs_0.safetensors", [1, 2, 3], num_prompt_tokens="1" * 1_000_000, last_token_id="7")
    assert convert(src, tmp_path / "sf") == 1
    line = error_line(capsys)
    assert len(line) < 600, len(line)
    assert line.startswith(f"error: {src / 'hs_0.safetensors'}: metadata num_prompt_tokens "
                           f"'1111111111"), line
    assert "(1000000 characters) is not a non-negative decimal integer" in line, line


# ---- --loss-mask-from with files of extract --generate ------------------------------------------
def test_loss_masks_of_data_for_generated_files_are_refused_saying_why(tmp_path, capsys):
    """A file with output rows holds the prompt (3 tokens) then the response's fed ids (2):
    DATA's loss_mask covers the prompt alone. Before, the refusal said the mask 'belongs to
    another prompt', which it does not."""
    src = tmp_path / "hs"
    src.mkdir()
    dump(src / "hs_0.safetensors", [1, 2, 3, 40, 41], num_prompt_tokens="3", last_token_id="42")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}) + "\n")
    assert convert(src, tmp_path / "sf", "--loss-mask-from", data) == 2
    assert error_line(capsys) == (
        f"error: --loss-mask-from {data}: hs_0.safetensors holds generated tokens (extract "
        f"--generate): its loss mask is the file's own (0 on the prompt, 1 on the response); "
        f"run convert without --loss-mask-from")
    assert not (tmp_path / "sf").exists()


# ---- deeply nested JSON where convert reads JSON ------------------------------------------------
def test_a_deeply_nested_image_token_id_is_one_sentence(tmp_path, capsys):
    src = tmp_path / "hs"
    src.mkdir()
    dump(src / "hs_0.safetensors", [1, 2, 3], image_token_id="[" * 100_000 + "]" * 100_000)
    assert convert(src, tmp_path / "sf") == 1
    assert error_line(capsys) == (
        f"error: {src / 'hs_0.safetensors'}: metadata image_token_id {'[' * 80!r} is not a "
        f"token id or a list of them; pass --image-token-id")


def test_a_deeply_nested_manifest_line_is_skipped_as_other_lines_that_are_not_json(src, tmp_path):
    (src / "manifest.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n"
                                        + json.dumps({"index": 0, "images": 0}) + "\n")
    assert convert(src, tmp_path / "sf") == 0
    assert record(tmp_path / "sf", 0)["input_ids"].tolist() == [10, 20, 30]


# ---- empty tensors ------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(0, 3, 8), (3, 3, 0)])
def test_a_file_without_tokens_or_channels_is_one_sentence(tmp_path, capsys, shape):
    """Before: 0 tokens was a RuntimeError traceback (reshape of 0 elements), hidden size 0
    a record of [1, 3, 0] written with exit 0."""
    src = tmp_path / "hs"
    src.mkdir()
    dump(src / "hs_0.safetensors", list(range(1, shape[0] + 1)), hidden=shape[2])
    assert convert(src, tmp_path / "sf") == 1
    assert error_line(capsys) == (
        f"error: {src / 'hs_0.safetensors'}: hidden_states {list(shape)} holds no "
        f"{'token' if shape[0] == 0 else 'channel'}, not a sample; run extract again with the "
        f"same --out to replace it")
    assert not (tmp_path / "sf").exists()


@pytest.mark.parametrize("dtype", ["int32", "bool", "float8_e5m2"])
def test_hidden_states_of_a_dtype_the_server_never_writes_are_refused(tmp_path, capsys, dtype):
    """Before: int32, bool and (scale-less) float8_e5m2 rows were saved as records of that
    dtype, exit 0."""
    src = tmp_path / "hs"
    src.mkdir()
    dump(src / "hs_0.safetensors", [1, 2, 3], dtype=getattr(torch, dtype))
    assert convert(src, tmp_path / "sf") == 1
    assert error_line(capsys) == (
        f"error: {src / 'hs_0.safetensors'}: hidden_states of torch.{dtype}, not a dtype the "
        f"server writes (bfloat16, float16, float32, or float8_e4m3fn with its scales); run "
        f"extract again with the same --out to replace it")
    assert not (tmp_path / "sf").exists()


def test_negative_token_ids_are_refused(tmp_path, capsys):
    """Before: a record with input_ids [1, -5, 3] was written (exit 0); SpecForge's
    embedding lookup fails on it at training time."""
    src = tmp_path / "hs"
    src.mkdir()
    dump(src / "hs_0.safetensors", [1, -5, 3])
    assert convert(src, tmp_path / "sf") == 1
    assert error_line(capsys) == (
        f"error: {src / 'hs_0.safetensors'}: token id -5 at position 1 is negative, not a token "
        f"id; run extract again with the same --out to replace it")


# ---- --model folders that are not checkpoints ---------------------------------------------------
@pytest.mark.parametrize("index, why", [
    ("not json", "model.safetensors.index.json is not JSON with a weight_map"),
    ('{"x": 1}', "model.safetensors.index.json is not JSON with a weight_map"),
    ('{"weight_map": {"model.norm.weight": "gone.safetensors"}}',
     "cannot read model.norm.weight from gone.safetensors"),
    (None, "cannot read model.safetensors (Error while deserializing header"),
])
def test_a_model_folder_whose_weights_cannot_be_read_is_one_sentence(src, tmp_path, capsys,
                                                                     index, why):
    """Before: JSONDecodeError, KeyError, FileNotFoundError or SafetensorError tracebacks."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": NUM_LAYERS,
                                                   "rms_norm_eps": 1e-5}))
    if index is None:  # a header that lists the norm, over bytes that are not there
        header = json.dumps({"model.norm.weight": {"dtype": "F32", "shape": [8],
                                                   "data_offsets": [0, 32]}}).encode()
        (model / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    else:
        (model / "model.safetensors.index.json").write_text(index)
    assert main(["convert", "--to", "specforge", str(src), str(tmp_path / "sf"), "--model",
                 str(model)]) == 2
    line = error_line(capsys)
    assert line.startswith(f"error: --model {model}: {why}"), line
    assert not (tmp_path / "sf").exists()


def test_an_rms_norm_eps_that_is_not_a_number_is_one_sentence(src, tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": NUM_LAYERS,
                                                   "rms_norm_eps": "tiny"}))
    save_file({"model.norm.weight": torch.ones(8)}, str(model / "model.safetensors"))
    assert main(["convert", "--to", "specforge", str(src), str(tmp_path / "sf"), "--model",
                 str(model)]) == 2
    assert error_line(capsys) == f"error: {model}/config.json's rms_norm_eps 'tiny' is not a number"


def test_a_config_json_that_is_not_an_object_is_one_sentence(src, tmp_path, capsys):
    """Before: AttributeError ('list' object has no attribute 'get'), a traceback."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("[1, 2]")
    assert main(["convert", "--to", "specforge", str(src), str(tmp_path / "sf"), "--model",
                 str(model)]) == 2
    assert error_line(capsys) == (f"error: {model / 'config.json'} is not readable JSON: not a "
                                  f"JSON object")


def test_a_norm_weight_that_is_not_one_dimensional_is_one_sentence(src, tmp_path, capsys):
    """A [H, 1] weight passed the length check; before, broadcasting it against [T, H] was a
    RuntimeError traceback (or, with T == H, a [H, H] hidden_state written)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": NUM_LAYERS,
                                                   "rms_norm_eps": 1e-5}))
    save_file({"model.norm.weight": torch.ones(8, 1)}, str(model / "model.safetensors"))
    assert main(["convert", "--to", "specforge", str(src), str(tmp_path / "sf"), "--model",
                 str(model)]) == 2
    assert error_line(capsys) == (f"error: --model {model}: model.norm.weight has shape [8, 1], "
                                  f"not [hidden_size]; pass --norm-key naming the final norm")


# ---- image token ids past int64 -----------------------------------------------------------------
def test_an_image_token_id_flag_past_int64_is_one_sentence(src, tmp_path, capsys):
    """Before: 'ValueError: Overflow when unpacking long long', a traceback."""
    assert convert(src, tmp_path / "sf", "--image-token-id", 2 ** 70) == 2
    assert error_line(capsys) == ("error: --image-token-id must be a non-negative token id "
                                  "(int64)")
    assert not (tmp_path / "sf").exists()


def test_a_metadata_image_token_id_past_int64_is_one_sentence(tmp_path, capsys):
    src = tmp_path / "hs"
    src.mkdir()
    dump(src / "hs_0.safetensors", [1, 2, 3], image_token_id=str(2 ** 70))
    assert convert(src, tmp_path / "sf") == 1
    assert error_line(capsys) == (
        f"error: {src / 'hs_0.safetensors'}: metadata image_token_id '{2 ** 70}' is not a token "
        f"id or a list of them; pass --image-token-id")


def test_a_rows_folder_that_is_a_file_is_one_sentence_without_a_disk_space_hint(src, tmp_path,
                                                                                capsys):
    dst = tmp_path / "sf"
    dst.mkdir()
    (dst / "rows_0-5000").write_text("a file where the group folder goes")
    assert convert(src, dst) == 1
    assert error_line(capsys) == (
        f"error: DST {dst}: cannot write {dst / 'rows_0-5000' / 'data_0.ckpt'} (File exists); "
        f"pass another DST, or fix this one, and run again: the records written are kept")


def test_a_kept_record_in_torchs_legacy_format_is_read_too(src, tmp_path, capsys):
    """torch.save(..., _use_new_zipfile_serialization=False) records cannot be mmapped; one of
    the same prompt is still kept (read whole), not refused as unreadable."""
    dst = tmp_path / "sf"
    (dst / "rows_0-5000").mkdir(parents=True)
    torch.save({"input_ids": torch.tensor([10, 20, 30])}, dst / "rows_0-5000" / "data_0.ckpt",
               _use_new_zipfile_serialization=False)
    assert convert(src, dst) == 0
    assert json.loads(capsys.readouterr().out)["skipped_existing"] == 1


# ---- two converts into one DST ------------------------------------------------------------------
def test_another_runs_temporary_record_is_left_alone(src, tmp_path):
    """Another convert into the same DST, writing data_0's record, holds the temporary name
    .data_0.ckpt.tmp with a partial record. Before, this run unlinked that name and made its
    own file there, so the other run's rename published this run's file, partial if it was
    still being written, under data_0.ckpt. Each run now has temporary names of its own."""
    dst = tmp_path / "sf"
    (dst / "rows_0-5000").mkdir(parents=True)
    theirs = dst / "rows_0-5000" / ".data_0.ckpt.tmp"
    theirs.write_bytes(b"PK\x03\x04 half a record")
    assert convert(src, dst) == 0
    assert theirs.read_bytes() == b"PK\x03\x04 half a record"
    assert record(dst, 0)["input_ids"].tolist() == [10, 20, 30]
    left = sorted(n for n in os.listdir(dst / "rows_0-5000") if n.startswith("."))
    assert left == [".data_0.ckpt.tmp"], left  # none of this run's temporary names stays


# ---- what torch.save writes -----------------------------------------------------------------------
@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("ids", [[7], [1, 2, 3, 4, 5]])
def test_each_record_tensor_owns_exactly_its_bytes(tmp_path, ids, with_norm):
    """torch.save writes a view's whole storage: a record tensor sharing the file's
    [T, L, H] storage would carry every slot again. Each must own exactly numel * itemsize
    bytes (T = 1 makes the aux slice contiguous, a view without a copy)."""
    src = tmp_path / "hs"
    src.mkdir()
    dump(src / "hs_0.safetensors", ids)
    ref = reference(ids)
    if with_norm:  # weight 1, eps 0: x / rms(x), in float32 (HF's RMSNorm), then bf16
        model = tmp_path / "model"
        model.mkdir()
        (model / "config.json").write_text(json.dumps({"num_hidden_layers": NUM_LAYERS,
                                                       "rms_norm_eps": 0.0}))
        save_file({"model.norm.weight": torch.ones(8)}, str(model / "model.safetensors"))
        assert main(["convert", "--to", "specforge", str(src), str(tmp_path / "sf"), "--model",
                     str(model)]) == 0
        last = ref[:, 2].float()
        want = (last / last.pow(2).mean(-1, keepdim=True).sqrt()).to(torch.bfloat16)
    else:
        assert convert(src, tmp_path / "sf") == 0
        want = ref[:, 2]
    rec = record(tmp_path / "sf", 0)
    assert torch.equal(rec["aux_hidden_state"][0], ref[:, :2].reshape(len(ids), -1))
    assert torch.allclose(rec["hidden_state"][0].float(), want.float(), rtol=2 ** -7, atol=0)
    for key, tensor in rec.items():
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size(), key
