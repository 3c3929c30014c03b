"""Which test files run first (see ``pytest_collection_modifyitems`` in ``tests/conftest.py``)."""

# The files that take longest, longest first: 11 s or more of one worker's time in a run of the whole
# suite on the 2-core machine (2026-12-05, two other busy processes beside it: about twice the idle
# figures), test_monitor.py placed by its time without the hang that run met (900 s).
# pytest-xdist hands each worker a whole file (``--dist loadfile``) in the order collected
# (``--no-loadscope-reorder``); its own order, most tests first, left the long files of a few tests
# (torchrun launches, kernel sweeps) to the end, one worker running them while the other sat idle.
# Started first, they finish while the other worker works through the many short files. Only the
# order changes: every test still runs. ``tests/test_suite_order.py`` checks that
# the files exist.
SLOWEST_FILES = (
    "tests/test_fla_import.py",
    "tests/ops/test_phase1_parallel_kernel.py",
    "tests/capture/test_kernel_exact.py",
    "tests/pipeline/test_run_integrity.py",
    "tests/report/test_report_workers.py",
    "tests/capture/test_capture.py",
    "tests/examples/test_examples.py",
    "tests/layers/test_osdn_layer.py",
    "tests/pipeline/test_multinode.py",
    "tests/test_monitor.py",
    "tests/view/test_view_browser.py",
    "tests/pipeline/test_fla_kernels_e2e.py",
    "tests/pipeline/test_distributed.py",
    "tests/pipeline/test_run.py",
    "tests/pipeline/test_resume_identity.py",
    "tests/ops/test_replay_kernel.py",
    "tests/capture/test_fla_interpreter.py",
    "tests/pipeline/test_what_if.py",
    "tests/capture/test_family_gated_deltaproduct.py",
    "tests/capture/test_api.py",
    "tests/pipeline/test_damaged_files.py",
    "tests/models/test_osdn_models.py",
    "tests/pipeline/test_result_hashes.py",
    "tests/math/test_math_equalities.py",
    "tests/test_tuning_table.py",
    "tests/report/test_tokens.py",
    "tests/pipeline/test_family_rwkv7_e2e.py",
    "tests/demo/test_demo.py",
    "tests/test_cli_errors.py",
    "tests/capture/test_osdn_capture.py",
    "tests/math/test_math_packing.py",
    "tests/report/test_text_report.py",
    "tests/layers/test_osgdn_layer.py",
    "tests/report/test_report_numbers.py",
    "tests/test_cli_warmup.py",
    "tests/test_hypothesis_batches.py",
    "tests/test_merge.py",
    "tests/capture/test_family_gdn2.py",
    "tests/test_python_guide.py",
    "tests/models/test_loading_dtypes.py",
    "tests/ops/test_osdn_chunk.py",
)
