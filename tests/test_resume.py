"""Resuming a run: one check compares the run directory with the config and reports every
difference at once, each with its way forward, before anything is written (issue 34, items
1, 12, 17, 18 and 19; issue 35's one resume check)."""

import shutil

import pytest

from flaxformer_lite.cli.train import train_main
from flaxformer_lite.data.config import DataConfig
from flaxformer_lite.data.inputs import built_inputs, write_inputs
from flaxformer_lite.data.store import prepare_store
from flaxformer_lite.train.config import load_config
from flaxformer_lite.train.loop import run
from flaxformer_lite.train.run_dir import RunDir

pytestmark = pytest.mark.fast_compile

TINY = [
    "model.num_decoder_layers=1",
    "model.d_model=32",
    "model.num_heads=2",
    "model.d_ff=64",
    "train.batch_size=8",
    "data.seq_len=16",
    "optimizer.warmup_steps=0",
    "train.eval_every=100",
    "train.eval_batches=1",
    "train.log_samples=0",
    "train.decode_examples=0",
]
TEXT = "".join(f"line {i}: the quick brown fox {i * 7 % 13}\n" for i in range(60))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run of 2 steps on a text file with a char tokenizer: ``(run_dir, its overrides)``."""
    root = tmp_path_factory.mktemp("trained")
    corpus = root / "corpus.txt"
    corpus.write_text(TEXT)
    overrides = [*TINY, "data.source=text", f"data.path={corpus}", "data.tokenizer=char"]
    run_dir = root / "run"
    run(
        load_config(None, [f"run_dir={run_dir}", *overrides, "train.steps=2"]),
        progress=False,
        log=_quiet,
    )
    return run_dir, overrides


def _quiet(_message):
    pass


def copy_of(trained, tmp_path):
    run_dir, overrides = trained
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    return copy, [f"run_dir={copy}", *overrides, "--no-progress"]


def snapshot(run_dir):
    """Every file of ``run_dir`` with its bytes, but the refused run's own: the lock, and the
    libraries' log (a failed restore's asyncio and orbax records, whenever they are collected)."""
    return {
        p.relative_to(run_dir): p.read_bytes()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and p.name not in ("run.lock", "library.log")
    }


def refused(args, capsys) -> str:
    status = train_main(args)
    err = capsys.readouterr().err
    assert status == 2, err
    return err


def test_resuming_with_fewer_steps_than_done_says_where_the_run_is(trained, tmp_path, capsys):
    run_dir, args = copy_of(trained, tmp_path)
    before = snapshot(run_dir)
    err = refused([*args, "train.steps=1"], capsys)
    assert f"{run_dir} is at step 2 already, past train.steps=1" in err, err
    assert "pass train.steps above 2 to train on" in err
    assert snapshot(run_dir) == before  # config.yaml not rewritten


def test_a_finished_run_run_again_says_there_is_nothing_to_do(trained, tmp_path, capsys):
    run_dir, args = copy_of(trained, tmp_path)
    assert train_main([*args, "train.steps=2"]) == 0
    out = capsys.readouterr().out
    assert f"{run_dir} is at step 2 = train.steps already" in out, out


def test_a_deleted_tokenizer_is_named(trained, tmp_path, capsys):
    run_dir, args = copy_of(trained, tmp_path)
    shutil.rmtree(run_dir / "tokenizer")
    before = snapshot(run_dir)
    err = refused([*args, "train.steps=3"], capsys)
    assert f"{run_dir / 'tokenizer'} is missing" in err, err
    assert "store" not in err and "--force" not in err  # --force cannot make its ids again
    err = refused([*args, "train.steps=3", "--force"], capsys)
    assert f"{run_dir / 'tokenizer'} is missing" in err, err
    assert snapshot(run_dir) == before


def test_every_difference_is_reported_at_once(trained, tmp_path, capsys):
    run_dir, args = copy_of(trained, tmp_path)
    corpus = tmp_path / "other.txt"
    corpus.write_text(TEXT + "one more line\n")
    before = snapshot(run_dir)
    err = refused(
        [*args, "train.steps=3", "model.d_ff=128", "optimizer.lr=1e-3", f"data.path={corpus}"],
        capsys,
    )
    assert "the config differs from the checkpoint's; pass --force to resume anyway" in err
    assert "model.d_ff: 64 -> 128" in err and "optimizer.lr:" in err, err
    assert "the data differ from those" in err and "data.path: '" in err, err
    assert snapshot(run_dir) == before


def test_an_extended_run_extends_and_resumes_again(trained, tmp_path, capsys):
    """Extending records the kept schedule span (optimizer.schedule_steps) in the checkpoint;
    the user never set it, so the next extension or resume is no change (issue 43 item 6)."""
    run_dir, args = copy_of(trained, tmp_path)
    for steps in (3, 4, 4):
        status = train_main([*args, f"train.steps={steps}"])
        captured = capsys.readouterr()
        assert status == 0, captured.err
    assert "is at step 4 = train.steps already" in captured.out, captured.out
    assert RunDir(run_dir).checkpoints.joinpath("4").is_dir()


def test_a_run_written_before_the_run_mark_resumes(trained, tmp_path, capsys):
    run_dir, args = copy_of(trained, tmp_path)
    RunDir(run_dir).mark.unlink()
    assert train_main([*args, "train.steps=3"]) == 0, capsys.readouterr().err
    assert RunDir(run_dir).mark.is_file() and (run_dir / "checkpoints" / "3").is_dir()


def test_a_run_directory_inside_the_data_glob_is_refused(tmp_path, capsys):
    """Issue 43 item 7: the run trained on its own run.lock, then listed its checkpoints as
    added data."""
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text(TEXT)
    run_dir = tmp_path / "corpus" / "run"
    args = [f"run_dir={run_dir}", *TINY, "data.source=text", "data.tokenizer=char"]
    err = refused([*args, f"data.path={tmp_path / 'corpus' / '**'}", "--no-progress"], capsys)
    assert f"data.path={tmp_path / 'corpus' / '**'} matches files of the run directory" in err
    assert "(run.json, run.lock); narrow the pattern to leave the run out" in err, err
    assert sorted(p.name for p in (tmp_path / "corpus").iterdir()) == ["a.txt"]


def test_text_documents_file_spelled_out_is_the_unset_setting(trained, tmp_path, capsys):
    """Issue 43 item 14: refused as "the data differ: None -> 'file'"."""
    run_dir, args = copy_of(trained, tmp_path)
    status = train_main([*args, "train.steps=3", "data.text_documents=file"])
    assert status == 0, capsys.readouterr().err
    assert (run_dir / "checkpoints" / "3").is_dir()


def test_force_cannot_change_the_shapes_of_the_checkpoint(trained, tmp_path, capsys):
    run_dir, args = copy_of(trained, tmp_path)
    before = snapshot(run_dir)
    err = refused([*args, "train.steps=3", "model.d_ff=128", "--force"], capsys)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "--force cannot change the checkpoint's arrays (model.d_ff changed): " in err, err
    assert "has shape (64,) there, (128,) here" in err, err
    assert "pass --fresh" in err
    assert snapshot(run_dir) == before
    assert not list(run_dir.glob("checkpoints/*.corrupt*"))  # no checkpoint set aside


def test_a_prepared_store_gone_from_under_a_run_is_named(tmp_path, capsys):
    store, corpus = tmp_path / "store", tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    prepare_store(store, source="text", path=str(corpus), tokenizer_name="char")
    run_dir = RunDir(tmp_path / "run")
    cfg = DataConfig(source="prepared", path=str(store), seq_len=16)
    with run_dir.locked():  # as a started run has
        write_inputs(run_dir.inputs, built_inputs(cfg, run_dir.prepared))
    shutil.rmtree(store)
    args = [f"run_dir={run_dir}", *TINY, "data.source=prepared", f"data.path={store}"]
    err = refused([*args, "--no-progress"], capsys)
    assert f"no prepared store at {store} (no manifest.json)" in err, err
    assert f"{corpus}: gone" not in err and "--force" not in err, err


def test_a_synthetic_run_with_a_leftover_data_path_resumes(tmp_path, capsys):
    """A generator's data need no store, whatever ``data.path`` says (it is unused)."""
    args = [f"run_dir={tmp_path / 'run'}", *TINY, "data.path=unused.txt", "--no-progress"]
    assert train_main([*args, "train.steps=1"]) == 0, capsys.readouterr().err
    assert train_main([*args, "train.steps=2"]) == 0, capsys.readouterr().err
    assert "no prepared store" not in capsys.readouterr().err


def test_a_resumed_run_s_warmup_notice_is_its_kept_schedule_s(tmp_path):
    """30 steps with a warmup of 100: 3 steps of warmup, said; raised to 40 on resume, the
    schedule keeps its 30-step span, and so does the notice."""
    settings = [*TINY, f"run_dir={tmp_path / 'run'}", "optimizer.warmup_steps=100"]
    settings += ["train.log_every=10", "checkpoint.every=10"]
    lines = []
    run(load_config(None, [*settings, "train.steps=30"]), progress=False, log=lines.append)
    said = "optimizer.warmup_steps (100) is longer than the schedule's 30 steps: warming up over 3"
    assert any(line.startswith(said) for line in lines), lines
    lines.clear()
    run(load_config(None, [*settings, "train.steps=40"]), progress=False, log=lines.append)
    assert any(line.startswith(said) for line in lines), lines


def test_a_run_that_logs_too_few_points_for_a_curve_says_so(tmp_path):
    lines = []
    settings = [*TINY, f"run_dir={tmp_path / 'run'}", "train.steps=20", "train.log_every=10"]
    cfg = load_config(None, settings)
    run(cfg, progress=False, log=lines.append)
    assert (
        "train.log_every=10 logs 2 point(s) of the run's 20 steps: its curves will show little; "
        "train.log_every=1 draws 20"
    ) in lines
