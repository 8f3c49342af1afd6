"""The quick tier, ``pytest -n 2 -m quick``: a few minutes on 2 cores, for while you develop;
``pytest -n auto`` (CI's command) still runs every test.

Its tests are those of the files below not marked ``slow``: files picked by their measured
time (``pytest --durations=0``), the cheapest that together import every module of the package
and name each part of it (``ops``, ``nn``, ``models``, ``data``, ``decode``, ``interop``,
``parallel``, ``train``, ``cli``, ``aot``, the top-level modules) in an import of their own;
``tests/test_quick_tier.py`` checks both. A file that gets slow leaves the list.
"""

QUICK_FILES = frozenset(
    {
        "test_source_records.py",
        "test_rows.py",
        "test_batches.py",
        "test_train_config.py",
        "test_tokenizers.py",
        "test_readers_streaming.py",
        "test_sources.py",
        "test_data_imports.py",
        "test_tokenizer_files.py",
        "test_prepare_cli.py",
        "test_pipeline_state.py",
        "test_store.py",
        "test_compare.py",
        "test_norms.py",
        "test_nn_stack.py",
        "test_projection.py",
        "test_pipeline.py",
        "test_cli_help.py",
        "test_choices.py",
        "test_parallel.py",
        "test_synthetic.py",
        "test_masks.py",
        "test_nn_modules.py",
        "test_sampling.py",
        "test_positions.py",
        "test_optim.py",
        "test_parallel_shards.py",
        "test_tasks.py",
        "test_time_spent.py",
        "test_quick_tier.py",
        "test_run_lock.py",
        "test_export.py",
        "test_interop_errors.py",
        "test_compile.py",
        "test_interop_tokenizer.py",
        "test_sweep.py",
        "test_transfer.py",
        "test_coord_check.py",
        "test_evals.py",
        "test_interop_peft.py",
        "test_lora.py",
    }
)
