"""The order in which the suite's files start: the slowest first, so that the pytest-xdist
workers end together instead of one running a long file alone at the end.

pyproject.toml's ``--dist loadfile --no-loadscope-reorder`` hands each worker whole files, in
the order conftest.py collects them: the files below first, slowest first, then the others as
they are found. A whole file to a worker also builds each module-scoped fixture (a trained
run, a sweep, an installed wheel) once, where handing out single tests built it on every
worker. The order comes from ``pytest -n 2 --durations=0``, each file's tests summed; a file
that gets much faster or slower moves.
"""

SLOWEST_FILES = (
    "test_context_parallel.py",
    "test_faults.py",
    "test_sweep.py",
    "test_multiprocess_faults.py",
    "test_demo.py",
    "test_readme.py",
    "test_multiprocess.py",
    "test_benchmark_shakespeare_char.py",
    "test_ablation.py",
    "test_resume.py",
    "test_benchmark_sweep.py",
    "test_packaging.py",
)
