"""The suite's set-up, which every test and every process a test starts shares. `make test`
runs on CPU with 8 fake devices (the Makefile's XLA_FLAGS); `make test-gpu` runs the same suite on
a GPU machine. The helpers that tests import live in `tests/helpers.py`; a folder's own fixtures
live in its conftest.py.
"""

import json
import os
import shutil
import tempfile
from pathlib import Path

# `make test-plan` adds the extra mptrain[plan]: JAX's CUDA plugin and libtpu beside its CPU
# backend. Where no NVIDIA driver is, JAX would try them first at every start and print their
# errors (which the tests that read stderr would see): there the suite, and every process it
# starts, runs on the CPU, as it would without the extra.
if not (Path("/proc/driver/nvidia").exists() or shutil.which("nvidia-smi")):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest

from mptrain import config as config_lib

# Dozens of tests (and the CLI processes they start) compile the same tiny programs: one
# persistent compilation cache for the session, its xdist workers and their subprocesses. It
# stores XLA's executables keyed by program, flags and devices, so no test sees other numbers.
_CACHE = {
    "JAX_COMPILATION_CACHE_DIR": str(Path(tempfile.gettempdir()) / "mptrain-tests-jax-cache"),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
}
# Tokenized text's cache (mptrain.data.tokenize) in the session's temp folder, never ~/.cache.
_CACHE["MPTRAIN_CACHE"] = str(Path(tempfile.gettempdir()) / "mptrain-tests-cache")
for _key, _value in _CACHE.items():
    os.environ.setdefault(_key, _value)
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
# A GPU runs fp32 matmuls in TF32 (10 mantissa bits) by default. The tests compare the recipe's
# numbers with references and with each other, not the hardware's shortcuts: full fp32 there.
if jax.default_backend() != "cpu":
    jax.config.update("jax_default_matmul_precision", "highest")


_BASE_CONFIG = config_lib.base_config


def _on_one_device():
    config = _BASE_CONFIG()
    config.mesh.data = 1
    return config


@pytest.fixture(scope="session", autouse=True)
def one_device_by_default():
    """In this process, a config trains on one device unless its test sets a mesh: `make test`
    gives the process 8 fake CPU devices for the tests that build meshes, and the default mesh
    (every device) would shard every in-process run 8 ways. The default itself is tested in
    fresh processes with exact device counts, and by tests marked `default_mesh`. Session-wide,
    so that module fixtures get it too."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(config_lib, "base_config", _on_one_device)
        yield


@pytest.fixture(autouse=True)
def _default_mesh_when_marked(request, monkeypatch):
    if request.node.get_closest_marker("default_mesh"):
        monkeypatch.setattr(config_lib, "base_config", _BASE_CONFIG)


# ---- what make test leaves to make test-slow -------------------------------------------------
# `make test` keeps one test of each behaviour; the second variant of a behaviour, a command
# line run that tests more than the command line, and the scripts whose runs compile anew move
# here, to `make test-slow` (which CI runs too). Each entry is a test id's end; a test
# marked `slow` in its own file is not listed. An entry that names no test of a collected file is
# an error, so a renamed test cannot slip back into make test unnoticed.
MOVED_TO_SLOW = {
    # signals: make test keeps Ctrl-C mid-run (CLI, exit 75, exact resume), SIGTERM at a step,
    # a signal while starting up, and exit 3 for runaway non-finite steps
    "fault_tolerance_test.py::test_ctrl_c_during_a_save_lets_it_finish_then_stops": "variant",
    "fault_tolerance_test.py::test_a_second_ctrl_c_exits_at_once_with_130_and_the_run_still_resumes": "variant",
    "fault_tolerance_test.py::test_sigterm_to_the_cli_exits_75_within_seconds": "variant",
    "fault_tolerance_test.py::test_sigterm_checkpoints_then_resume_is_exact[eval-4]": "variant",
    "fault_tolerance_test.py::test_a_forked_worker_does_not_turn_one_ctrl_c_into_two": "variant",
    "fault_tolerance_test.py::test_a_dynamic_scale_stuck_at_its_minimum_exits_3": "variant",
    "fault_tolerance_test.py::test_corrupt_newest_checkpoint_falls_back_and_finishes_identically": "variant",
    # a refused resume: bad_input_test keeps the advice it gives
    "fault_tolerance_test.py::test_resuming_with_another_model_or_precision_is_refused": "variant",
    # scripts/bench.py: make test keeps the LM's hand-written side in bf16-mixed and its FLOPs
    "bench_test.py::test_the_hand_written_side_trains_the_same_model[lm-fp32]": "variant",
    "bench_test.py::test_the_hand_written_side_trains_the_same_model[lm-fp16-mixed+dyn]": "variant",
    "bench_test.py::test_the_hand_written_side_trains_the_same_model[resnet-bf16-mixed+dyn]": "variant",
    "bench_test.py::test_lm_flops_from_the_config_are_what_the_traced_program_computes[lm_gpt2s-fp16-mixed+dyn]": "variant",
    "bench_test.py::test_resnet_flops_are_three_traced_forward_passes_of_its_shapes": "script",
    "bench_test.py::test_bench_writes_its_table_and_json": "script",
    # fp8 and 8-bit moments: make test keeps their steps, skips and the recipe's choices; the
    # resumes are the Trainer's (trainer_test keeps byte-identical resume)
    "fp8_step_test.py::test_a_layer_clipped_again_and_again_is_named_at_the_log_step": "run",
    "fp8_step_test.py::test_micro_batches_of_one_batch_give_one_history_entry_with_the_batchs_amaxes": "run",
    "fp8_step_test.py::test_a_resumed_fp8_run_equals_the_uninterrupted_one": "variant",
    "q8_test.py::test_a_resumed_q8_run_equals_the_uninterrupted_one": "variant",
    # the scanned fp8 Llama: make test keeps current scaling (the Llama's default)
    "fp8_scan_test.py::test_the_scanned_fp8_llama_trains_as_the_unrolled_one[delayed]": "variant",
    # the zoo: make test keeps the default LM, the Llama and the ResNet's two steps, and fp16
    # batch statistics through a skipped step
    "zoo_configs_test.py::test_two_steps_of_every_tiny_config_run[lm_bf16]": "variant",
    "zoo_configs_test.py::test_two_steps_of_every_tiny_config_run[lm_fp16]": "variant",
    "zoo_configs_test.py::test_two_steps_of_every_tiny_config_run[mnist_cnn]": "variant",
    "zoo_configs_test.py::test_two_steps_of_every_tiny_config_run[custom_trainer]": "variant",
    "zoo_configs_test.py::test_cifar10_resnet_tiny_fp16_keeps_fp32_batch_stats_and_resumes_them": "variant",
    # the command line under each preset: make test keeps bf16-mixed
    "trainer_test.py::test_every_preset_runs_the_tiny_default_from_the_cli[fp32]": "variant",
    "trainer_test.py::test_every_preset_runs_the_tiny_default_from_the_cli[fp16-mixed]": "variant",
    "trainer_test.py::test_every_preset_runs_the_tiny_default_from_the_cli[bf16-pure]": "variant",
    # the TPU flash kernel in interpret mode: make test keeps grouped-query attention in fp32
    "attention_test.py::test_the_tpu_flash_kernel_matches_the_materialized_path_in_interpret_mode[mha-2-bf16]": "variant",
    "attention_test.py::test_the_tpu_flash_kernel_matches_the_materialized_path_in_interpret_mode[mha-2-fp32]": "variant",
    # per-layer numerics: make test keeps the sites' names and the fp16 overflow's module
    "numerics_test.py::test_the_precision_report_counts_an_ordinary_steps_matmuls": "variant",
    "workdir_test.py::test_an_export_while_the_run_saves_leaves_the_save_alone": "run",
    # the NNX example: make test keeps its step's dtypes, its batch statistics and attention
    "nnx_example_test.py::test_trains_from_the_command_line_under_every_preset[bf16-mixed]": "cli",
    "nnx_example_test.py::test_resume_is_byte_identical": "variant",
    "nnx_example_test.py::test_per_layer_numerics_on_an_nnx_model_record_nothing_and_harm_nothing": "variant",
    "synthetic_images_test.py::test_tiny_image_configs_train_from_the_cli_without_tensorflow[cifar10_resnet]": "variant",
    "record_test.py::test_a_stop_inside_a_log_interval_logs_what_the_straight_run_logs[7]": "variant",
    # remat: llama_test keeps scan and remat computing what unrolled layers do
    "transformer_lm_test.py::test_remat_changes_what_is_kept_not_what_is_computed": "variant",
    # a Trainer subclass: custom_trainer_test keeps one in this process
    "custom_trainer_example_test.py::test_runs_from_the_command_line": "cli",
    # the default mesh on eight devices: trainer_test keeps data-parallel and FSDP meshes
    "validation_test.py::test_the_default_mesh_trains_on_every_device": "variant",
    # processes: make test keeps meshes and FSDP in this process (trainer_test, sharding_test)
    # and a signal that stops a run in-process (SIGTERM at a step, resumed exactly)
    "multihost_test.py::test_two_processes_train_like_one_process_with_four_devices": "processes",
    "fault_tolerance_test.py::test_ctrl_c_mid_run_checkpoints_the_steps_done_and_resume_is_exact": "processes",
    "bad_input_test.py::test_a_stop_signal_during_a_long_evaluation_stops_within_a_batch": "variant",
    "zoo_configs_test.py::test_two_steps_of_every_tiny_config_run[cifar10_resnet]": "variant",
    "export_test.py::test_an_hf_export_that_cannot_be_written_is_exit_1_naming_it[read-only filesystem]": "variant",
    "workdir_test.py::test_a_runs_json_files_follow_the_umask": "variant",
    "bench_test.py::test_the_hand_written_side_trains_the_same_model[lm-bf16-mixed]": "script",
    "validation_test.py::test_kahan_compensation_is_counted_in_the_state_bytes": "variant",
    "llama_test.py::test_scan_and_remat_compute_what_unrolled_layers_without_remat_do[minimal]": "variant",
    # make test keeps scan and full remat against unrolled layers without remat on the
    # dense-first expert folder's two stacks (experts_test), one program for both sides
    "llama_test.py::test_scan_and_remat_compute_what_unrolled_layers_without_remat_do[full]": "variant",
    "llama_test.py::test_the_fp32_forward_equals_a_numpy_reference_past_the_original_context[mha_1to1]": "variant",
    "sharding_test.py::test_gradients_reduce_in_fp32_and_params_gather_in_16_bits[fp16-mixed-8-1]": "variant",
    # the same function at more shapes, dtypes or chunkings: make test keeps one of each kind
    "attention_test.py::test_the_cudnn_call_computes_what_the_materialized_path_does[mha-12]": "variant",
    "attention_test.py::test_the_cudnn_call_computes_what_the_materialized_path_does[gqa-4-2]": "variant",
    "attention_test.py::test_the_cudnn_call_computes_what_the_materialized_path_does[mqa-4-1]": "variant",
    "attention_test.py::test_grouped_materialized_attention_is_attention_over_kv_heads_repeated_per_query_head[1]": "variant",
    "attention_test.py::test_grouped_materialized_attention_is_attention_over_kv_heads_repeated_per_query_head[8]": "variant",
    "lm_loss_test.py::test_chunked_loss_and_gradients_are_the_unchunked_ones[1-float32]": "variant",
    "lm_loss_test.py::test_chunked_loss_and_gradients_are_the_unchunked_ones[1-bfloat16]": "variant",
    "lm_loss_test.py::test_chunked_loss_and_gradients_are_the_unchunked_ones[3-bfloat16]": "variant",
    "lm_loss_test.py::test_chunked_loss_and_gradients_are_the_unchunked_ones[4-float32]": "variant",
    "lm_loss_test.py::test_chunked_loss_and_gradients_are_the_unchunked_ones[None-bfloat16]": "variant",
    "lm_loss_test.py::test_chunked_loss_and_gradients_are_the_unchunked_ones[16-float32]": "variant",
    "lm_loss_test.py::test_chunked_loss_and_gradients_are_the_unchunked_ones[64-bfloat16]": "variant",
    "lm_loss_test.py::test_a_batch_without_a_valid_target_has_loss_0_and_zero_gradients[bfloat16]": "variant",
    "lm_loss_test.py::test_a_batch_split_over_devices_is_not_gathered[3]": "variant",
    "transformer_lm_test.py::test_einsum_f32_out_gradients_match_autodiff[aby,yz->abz]": "variant",
    "hf_test.py::test_loaded_weights_give_transformers_fp32_logits[untied-scanned]": "variant",
    "hf_test.py::test_loaded_weights_give_transformers_fp32_logits[tied-unscanned]": "variant",
    "audit_test.py::test_a_sum_across_devices_in_bf16_is_named_and_the_framework_sums_in_fp32[SummingTrainer]": "variant",
    "models_test.py::test_batch_stats_update_in_fp32_and_eval_uses_them[float16]": "variant",
    "optim_test.py::test_a_gated_optimizer_keeps_its_state_where_a_step_is_not_applied[adamw-q8]": "variant",
    # third round, by the seconds each took in a cold make test (the family's other tests stay)
    "numerics_test.py::test_every_injection_site_is_named_with_its_direction[forward]": "variant",
    "numerics_test.py::test_every_injection_site_is_named_with_its_direction[backward]": "variant",
    "bad_input_test.py::test_a_refused_resume_gives_one_advice_in_clean_sentences": "variant",
    "bad_input_test.py::test_a_record_that_cannot_be_written_stops_after_a_checkpoint": "variant",
    "bad_input_test.py::test_more_eval_steps_than_the_eval_split_holds_are_told": "variant",
    "zoo_configs_test.py::test_two_steps_of_every_tiny_config_run[llama3]": "variant",
    "loop_test.py::test_four_steps_per_call_resume_to_the_same_bytes": "variant",
    "attention_test.py::test_the_tpu_flash_kernel_matches_the_materialized_path_in_interpret_mode[gqa-4-2-fp32]": "variant",
    "attention_test.py::test_the_cudnn_call_computes_what_the_materialized_path_does[gqa-12-4]": "variant",
    "synthetic_images_test.py::test_tiny_image_configs_train_from_the_cli_without_tensorflow[mnist_cnn]": "cli",
    "golden_test.py::test_one_step_golden_values[fp16-mixed]": "variant",
    "golden_test.py::test_one_step_golden_values[bf16-pure]": "variant",
    "record_test.py::test_a_log_step_checkpointed_has_its_line_written_first": "variant",
    "export_test.py::test_an_out_that_cannot_be_written_is_exit_1_naming_it[read-only filesystem]": "variant",
    "record_edges_test.py::test_the_exit_3_message_names_the_checkpoint_it_wrote": "variant",
    "workdir_test.py::test_a_resume_with_other_intervals_or_learning_rate_goes_on": "variant",
    # fourth round, by the programs each compiled (files over 20 KB in the compilation cache)
    "nnx_example_test.py::test_bf16_mixed_step_runs_its_matmuls_in_bf16_and_scatters_nothing": "variant",
    "bad_input_test.py::test_the_casting_rule_does_what_it_says": "variant",
    "checkpoint_test.py::test_bf16_kahan_state_round_trips": "variant",
    "llama_test.py::test_the_fp32_forward_equals_a_numpy_reference_past_the_original_context[gqa_2to1_tied]": "variant",
    "transformer_lm_test.py::test_einsum_f32_out_gradients_match_autodiff[bqhd,bkhd->bhqk]": "variant",
    "fp8_step_test.py::test_the_config_chooses_the_recipe_the_layers_and_the_step_use": "variant",
    "export_test.py::test_an_out_that_cannot_be_written_is_exit_1_naming_it[disk full]": "variant",
    "audit_test.py::test_a_max_pool_shows_its_select_and_scatter": "variant",
    "trainer_test.py::test_init_state_and_evaluate_work_on_their_own[bf16-pure-stochastic]": "variant",
    "bench_test.py::test_lm_flops_from_the_config_are_what_the_traced_program_computes[default-fp32]": "script",
    "hf_test.py::test_loaded_weights_give_transformers_fp32_logits[tied-scanned]": "variant",
    "hf_test.py::test_bf16_mixed_logits_stay_within_the_stated_bound[tied]": "variant",
    "lm_loss_test.py::test_chunked_loss_and_gradients_are_the_unchunked_ones[4-bfloat16]": "variant",
    "lm_loss_test.py::test_no_array_of_the_batch_times_the_vocabulary_exists[4]": "variant",
    "lm_loss_test.py::test_a_batch_without_a_valid_target_has_loss_0_and_zero_gradients[float32]": "variant",
    # fifth round, by the programs no other test compiles (issue 55's session): make test keeps
    # the default LM's, the Llama's and the ResNet's configs training, a refused resume of
    # other adapters (their targets), and the bf16 table's gather
    "zoo_configs_test.py::test_mnist_cnn_tiny_trains_on_mock_data": "variant",
    "lora_test.py::test_a_resume_with_other_adapters_names_the_key[lora.rank-8]": "variant",
    "audit_test.py::test_a_gather_from_an_fp32_table_is_listed_as_nondeterministic_and_not_warned": "variant",
    # the chunked loss's gradients: make test keeps the cross-entropy's through chunks, and the
    # z-loss's value at the model (transformer_lm_test)
    "lm_loss_test.py::test_z_loss_is_the_mean_squared_log_normaliser": "variant",
    # the fixture's power to tell a wrong layout: make test keeps its logits against transformers
    "hf_test.py::test_the_fixture_tells_a_wrong_qk_order_and_ignored_rope_scaling_apart": "variant",
    "nnx_example_test.py::test_the_example_chooses_attention_by_the_zoos_rule_and_keeps_its_params": "variant",
    # the unrolled layers' logits against transformers: make test keeps the scanned ones, and
    # the decoder runs the unrolled layers against transformers' generate (generate_test)
    "hf_test.py::test_loaded_weights_give_transformers_fp32_logits[untied-unscanned]": "variant",
    # sixth round, for DPO's programs (issue 58): make test keeps the gated optimizer's fp32
    # and SGD states, the default precision's golden step, and the skip of an fp16 overflow
    "optim_test.py::test_a_gated_optimizer_keeps_its_state_where_a_step_is_not_applied[adamw-bf16]": "variant",
    "golden_test.py::test_one_step_golden_values[fp32]": "variant",
    "step_test.py::test_non_finite_step_is_skipped_without_touching_the_state[nan_batch]": "variant",
    # for the MoE layer's program (issue 59): make test keeps stochastic rounding through the
    # compiled step that drops f32 -> bf16 -> f32 round trips, the stricter of the two
    "param_rounding_test.py::test_stochastic_and_kahan_keep_small_updates[stochastic-bf16-jit]": "variant",
}


@pytest.hookimpl(tryfirst=True)  # before -m reads the marks
def pytest_collection_modifyitems(config, items):
    found = set()
    for item in items:
        end = item.nodeid.rsplit("/", 1)[-1]
        if end in MOVED_TO_SLOW:
            item.add_marker(pytest.mark.slow)
            found.add(end)
    files = {item.nodeid.rsplit("/", 1)[-1].split("::")[0] for item in items}
    missing = [e for e in MOVED_TO_SLOW if e.split("::")[0] in files and e not in found]
    if missing and len(items) > 1:
        raise pytest.UsageError(f"MOVED_TO_SLOW names no test: {missing}")


# ---- where the suite's time goes: MPTRAIN_TEST_COMPILES=<file> ------------------------------
# One JSON line a test: its seconds, the programs this process compiled during it (XLA backend
# compiles, their seconds) and the files it added to the persistent compilation cache (this
# process's and its subprocesses'; with xdist's workers sharing the folder, run with -p no:xdist
# for exact counts). A file over 20 KB is a train or eval step, a model's init or an eager
# random draw (each shape its own program).
_COMPILE_LOG = os.environ.get("MPTRAIN_TEST_COMPILES")
if _COMPILE_LOG:
    import time

    _compiles: list[float] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **_: (
            _compiles.append(secs)
            if event == "/jax/core/compile/backend_compile_duration"
            else None
        )
    )

    def _cache_files() -> dict[str, int]:
        with os.scandir(os.environ["JAX_COMPILATION_CACHE_DIR"]) as it:
            return {e.name: e.stat().st_size for e in it}

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        before, start = _cache_files(), time.perf_counter()
        _compiles.clear()
        yield
        new = {name: size for name, size in _cache_files().items() if name not in before}
        added = list(new.values())
        line = {
            "test": item.nodeid,
            "seconds": round(time.perf_counter() - start, 2),
            "compiles": len(_compiles),
            "compile_seconds": round(sum(_compiles), 2),
            "cache_files": len(added),
            "cache_files_over_20kb": sum(size > 20_000 for size in added),
            # their programs' names: jit_train_step, or jit__normal for an eager random draw
            "over_20kb": sorted(n.split("-", 1)[0] for n, size in new.items() if size > 20_000),
        }
        with open(_COMPILE_LOG, "a") as f:
            f.write(json.dumps(line) + "\n")
