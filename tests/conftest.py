"""Shared fixtures: a tiny random Llama saved to disk, a store in a temp dir, a worker."""

from __future__ import annotations

import os
from pathlib import Path

# Without a GPU, Triton kernels run in the interpreter; set before anything imports triton.
if not Path("/dev/nvidia0").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from lab.tiny_random import TinyLlamaSpec, build_tiny_llama
from store.config import StoreConfig
from store.kvstore import KVStore
from workers.engine import Worker
from workers.model import LoadedModel, load_model

TEST_PAGE_SIZE = 16


SLOW_IN_THE_INNER_LOOP = (
    # measured 2026-11-29 after the suite grew (make test-fast 5:49 on the VM)
    "tests/test_store_durable.py::test_damaged_lmdb_is_moved_aside_and_rebuilt_without_a_crash[truncated]",  # 5.1 s
    "tests/test_store.py::test_crash_mid_write[before_rename]",  # 3.1 s
    "tests/test_topk_shared_index.py::test_generations_over_one_prefix_share_the_index_and_its_decoded_keys",  # 2.2 s
    "tests/test_train_continued.py::test_loop_ramps_the_cap_across_a_resume_and_trains_the_gates",  # 1.9 s
    "tests/test_shipped_model.py::test_greedy_retrieval_survives_a_kvzip_cache_at_half_the_kv",  # 1.8 s
    "tests/test_train_continued.py::test_loop_holds_the_mean_gate_up_with_a_floor",  # 1.8 s
    "tests/test_kernel_quest_scores.py::test_triton_equals_reference[1-8-128-4-300-bf16]",  # 1.7 s
    "tests/test_quest_shared_bounds.py::test_generations_over_one_prefix_share_its_stacked_bounds",  # 1.6 s
    "tests/test_gateway_fuzz.py::test_gateway_answers_every_generated_request_within_its_schema[POST-/v1/completions]",
    "tests/test_metadata_contract.py::test_prefill_lock_is_renewed_while_held[redis]",  # 1.5 s
    "tests/test_kernel_doublep_select.py::test_kernel_equals_the_torch_reference[False-True-True-1-8-1000-8000-3]",
    "tests/test_phi_distill.py::test_the_worker_uses_a_shipped_map",  # 1.4 s
    "tests/test_metadata_contract.py::test_prefill_lock_times_out_then_frees_when_its_holder_crashes[redis]",  # 1.4 s
    "tests/test_gateway_fuzz.py::test_gateway_answers_every_generated_request_within_its_schema[GET-/v1/prefixes]",
    "tests/test_step_graph.py::test_a_generation_outgrowing_its_own_buffer_gets_a_new_static_step[8]",  # 1.4 s
    "tests/test_decode_batch.py::test_time_to_first_token_counts_the_open",  # 1.3 s
    "tests/test_gateway_recovery.py::test_a_client_that_goes_away_frees_the_worker[openai-plain]",  # 1.3 s
    "tests/test_streamed_summary.py::test_a_layers_bounds_come_before_the_later_layers_are_read",  # 1.3 s
    "tests/test_scheduler.py::test_tenants_share_model_time_when_their_steps_cost_differently",  # 1.2 s
    "tests/test_kernel_page_entries.py::test_triton_equals_reference_and_page_step[8-513-16-1]",  # 1.2 s
    "tests/test_kernel_quest_scores.py::test_triton_equals_reference[1-8-128-4-300-fp32]",  # 1.2 s
    "tests/test_kernel_doublep_select.py::test_kernel_equals_the_torch_reference[False-False-True-1-8-1000-8000-3]",
    "tests/test_bench_smoke.py::test_ratplus_cost_quick_compares_both_models",  # 12.1 s
    "tests/test_bench_smoke.py::test_compress_time_quick_scores_through_prefill",  # 8.9 s
    "tests/test_bench_smoke.py::test_scratch_dir_is_removed_when_the_bench_is_terminated",  # 8.5 s
    "tests/test_client_imports.py::test_embedded_client_still_gets_the_worker",  # 8.1 s
    "tests/test_prefill_compress.py::test_the_cli_prefill_takes_compress",  # 8.0 s
    "tests/test_cli_failures.py::test_bad_arguments_fail_in_one_line[generate",  # 7.9 s
    "tests/test_streamed_artifacts.py::test_prefill_summaries_are_written_layer_by_layer",  # 6.3 s
    "tests/test_shipped_model.py::test_shipped_model_retrieves_needles",  # 6.0 s
    "tests/test_offload_device_plan.py::test_rows_lru_and_counts_match_reference[13-256-triton-True]",  # 4.4 s
    "tests/test_store_durable.py::test_damaged_lmdb_is_moved_aside_and_rebuilt_without_a_crash[not_lmdb]",  # 4.3 s
    "tests/test_kernel_decay_scan.py::test_triton_gradients_equal_reference[lengths2-2-20-config2-False]",  # 4.3 s
    "tests/test_phi_diagnose.py::test_phi_diagnose_runs_and_its_null_fixes_change_nothing",  # 3.8 s
    "tests/test_cli_failures.py::test_cuda_without_a_gpu_is_a_clean_error",  # 3.7 s
    "tests/test_kernel_kmeans_assign.py::test_exact_ties_break_to_lower_index[3-200-300-96-bf16-small-blocks]",  # 3.7 s
    "tests/test_kernel_quest_scores.py::test_members_equal_each_members_own_launch[range-4-8-4-128-1-bf16]",  # 3.7 s
    "tests/test_step_ahead.py::test_the_device_sampler_draws_from_the_nucleus_distribution",  # 3.7 s
    "tests/test_kernel_decay_scan.py::test_triton_gradients_equal_reference[lengths2-2-20-config2-True]",  # 3.6 s
    "tests/test_kernel_page_plan.py::test_triton_equals_reference[3-100-7-15-2-256]",  # 3.6 s
    "tests/test_offload_device_plan.py::test_rows_lru_and_counts_match_reference[24-4-triton-True]",  # 3.5 s
    "tests/test_kernel_quest_scores.py::test_members_equal_each_members_own_launch[whole-4-8-4-128-17-bf16]",  # 3.2 s
    "tests/test_kernel_page_plan.py::test_triton_equals_reference[3-200-5-37-2-8]",  # 3.2 s
    "tests/test_kernel_page_plan.py::test_triton_equals_reference[2-41-6-13-0-256]",  # 3.0 s
    "tests/test_cli_commands.py::test_rm_refuses_a_prefix_in_use_unless_forced",  # 3.0 s
    "tests/test_kernel_quest_scores.py::test_members_equal_each_members_own_launch[whole-4-8-4-128-1-bf16]",  # 3.0 s
    "tests/test_store_background_sync.py::test_a_process_killed_before_its_background_sync_loses_nothing",  # 3.0 s
    "tests/test_kernel_kmeans_assign.py::test_exact_ties_break_to_lower_index[3-200-300-96-fp32-small-blocks]",  # 2.9 s
    "tests/test_kernel_quest_scores.py::test_members_equal_each_members_own_launch[range-4-8-4-128-17-bf16]",  # 2.9 s
    "tests/test_kernel_rope_rms_norm.py::test_rope_kernel_equals_transformers[1-6-3-17-80-bf16]",  # 2.9 s
    "tests/test_store.py::test_crash_mid_write[before_metadata]",  # 2.8 s
    "tests/test_store.py::test_crash_mid_write[after_layer]",  # 2.8 s
    "tests/security/test_security_tls.py::test_partial_config_is_a_clean_exit_not_a_traceback",  # 2.7 s
    "tests/test_kernel_decay_scan.py::test_split_scan_continues_from_last_state[True]",  # 2.6 s
    "tests/test_kernel_quest_scores.py::test_members_equal_each_members_own_launch[whole-4-8-4-128-1-fp32]",  # 2.6 s
    "tests/test_metadata_contract.py::test_redis_down_is_store_unavailable",  # 2.5 s
    "tests/test_cli_commands.py::test_info_and_ls_tell_a_damaged_prefix_and_verify_reads_pages",  # 2.5 s
    "tests/test_kernel_sparse_attention.py::test_small_blocks_many_splits",  # 2.4 s
    "tests/test_offload_device_plan.py::test_triton_plan_equals_torch_plan",  # 2.3 s
    "tests/test_kernel_rope_rms_norm.py::test_rope_kernel_equals_transformers[1-32-8-3-128-bf16]",  # 2.3 s
    "tests/test_kernel_quest_scores.py::test_members_equal_each_members_own_launch[range-4-8-4-128-17-fp32]",  # 2.2 s
    "tests/test_kernel_quest_scores.py::test_members_equal_each_members_own_launch[whole-4-8-4-128-17-fp32]",  # 2.1 s
    # 2.1 s
    "tests/test_gateway_fuzz.py::test_gateway_answers_every_generated_request_within_its_schema[POST-/v1/chat/completions]",
    "tests/test_gateway_recovery.py::test_gateway_stubs_reconnect_quickly_to_a_restarted_server",  # 2.1 s
    "tests/test_kernel_quest_scores.py::test_members_equal_each_members_own_launch[range-4-8-4-128-1-fp32]",  # 2.0 s
    "tests/test_cli_failures.py::test_missing_prefix_is_not_found",  # 2.0 s
    "tests/test_kernel_decay_scan.py::test_triton_forward_equals_reference[lengths2-2-20-config2-True-dtype1]",  # 1.9 s
    "tests/test_eval_accuracy.py::test_concurrent_eval_batches_and_scores_the_same",  # 1.9 s
    # 1.8 s
    "tests/test_gateway_fuzz.py::test_gateway_answers_every_generated_request_within_its_schema[POST-/v1/prefixes]",
    "tests/test_kernel_rope_rms_norm.py::test_rope_kernel_equals_transformers[2-8-2-5-64-bf16]",  # 1.8 s
    # 1.7 s
    "tests/test_kernel_decay_scan.py::test_triton_forward_equals_reference[lengths2-2-20-config2-False-dtype0]",
    "tests/test_kernel_page_plan.py::test_triton_equals_reference[2-300-6-50-0-4]",  # 1.7 s
    # 1.7 s
    "tests/test_kernel_doublep_select.py::test_kernel_equals_the_torch_reference[True-True-True-1-8-1000-8000-3]",
    "tests/test_kernel_decay_scan.py::test_triton_forward_equals_reference[lengths2-2-20-config2-True-dtype0]",  # 1.6 s
    # 1.6 s
    "tests/test_step_ahead.py::test_threads_pulling_closing_and_cancelling_get_the_tokens_of_each_generation_alone",
    "tests/test_kernel_quest_scores.py::test_triton_equals_reference[1-8-128-1-300-bf16]",  # 1.5 s
    "tests/test_store_capacity.py::test_lease_marks_use_and_keeps_itself_alive[redis]",  # 1.5 s
    "tests/test_store_capacity.py::test_lease_marks_use_and_keeps_itself_alive[lmdb]",  # 1.5 s
    # 1.5 s
    "tests/test_kernel_decay_scan.py::test_triton_forward_equals_reference[lengths2-2-20-config2-False-dtype1]",
    "tests/test_kernel_gather_pages.py::test_triton_equals_reference[True-16-128-dtype1-chunks]",  # 2.2 s
    # 2.0 s
    "tests/test_kernel_unit_topk.py::test_group_top_units_selects_the_reference_mass[dtype0-3-5-129-100-split]",
    # 2.0 s
    "tests/test_kernel_unit_topk.py::test_group_top_units_selects_the_reference_mass[dtype1-3-5-129-100-split]",
    "tests/test_kernel_unit_topk.py::test_top_units_orders_signs_zeros_and_infinities",  # 1.8 s
    "tests/test_kernel_unit_topk.py::test_top_units_equals_reference[dtype0-2-257-256-split]",  # 1.8 s
    "tests/test_kernel_gather_pages.py::test_triton_equals_reference[False-16-128-dtype1-chunks]",  # 1.8 s
    # 1.6 s
    "tests/test_kernel_doublep_select.py::test_kernel_equals_the_torch_reference[True-False-True-1-8-1000-8000-0]",
    # 1.6 s
    "tests/test_kernel_doublep_select.py::test_kernel_equals_the_torch_reference[True-False-True-1-8-1000-8000-3]",
    # 1.6 s
    "tests/test_kernel_doublep_select.py::test_kernel_equals_the_torch_reference[False-True-True-1-8-1000-8000-0]",
    # 1.6 s
    "tests/test_kernel_doublep_select.py::test_kernel_equals_the_torch_reference[False-True-False-1-8-1000-8000-0]",
    "tests/test_kernel_kmeans_assign.py::test_strided_and_mixed_dtype_inputs[small-blocks]",  # 1.6 s
    "tests/test_kernel_unit_topk.py::test_top_units_equals_reference[dtype1-2-257-256-split]",  # 1.5 s
    # 1.5 s
    "tests/test_kernel_kmeans_assign.py::test_kmeans_through_the_kernel_equals_the_reference_path[small-blocks]",
    "tests/test_kernel_sparse_attention.py::test_merge_of_disjoint_parts_equals_union",  # 1.5 s
    # 1.5 s
    "tests/test_kernel_doublep_select.py::test_kernel_equals_the_torch_reference[True-False-False-1-8-1000-8000-0]",
    "tests/test_kernel_quest_scores.py::test_triton_equals_reference[1-8-128-5-300-bf16]",  # 1.5 s
    # 1.4 s
    "tests/test_kernel_doublep_select.py::test_kernel_equals_the_torch_reference[False-False-True-1-8-1000-8000-0]",
    "tests/test_kernel_page_plan.py::test_triton_equals_reference[1-9-4-8-4-256]",  # 1.4 s
    "tests/test_kernel_quest_scores.py::test_triton_equals_reference[1-8-128-1-300-fp32]",  # 1.3 s
    # 1.3 s
    "tests/test_kernel_doublep_select.py::test_kernel_equals_the_torch_reference[False-False-False-1-8-1000-8000-0]",
    # 1.3 s
    "tests/test_kernel_doublep_select.py::test_kernel_equals_the_torch_reference[True-False-False-1-8-1000-8000-3]",
    # 1.2 s
    "tests/test_kernel_doublep_select.py::test_kernel_equals_the_torch_reference[False-False-False-1-8-1000-8000-3]",
    # 1.2 s
    "tests/test_kernel_doublep_select.py::test_kernel_equals_the_torch_reference[True-True-True-1-8-1000-8000-0]",
    "tests/test_kernel_quest_scores.py::test_triton_equals_reference[1-8-128-5-300-fp32]",  # 1.2 s
    # 1.2 s
    "tests/test_kernel_doublep_select.py::test_kernel_equals_the_torch_reference[False-True-False-1-8-1000-8000-3]",
    # 1.1 s
    "tests/test_kernel_doublep_select.py::test_kernel_equals_the_torch_reference[True-True-False-1-8-1000-8000-3]",
    # 1.1 s
    "tests/test_kernel_doublep_select.py::test_kernel_equals_the_torch_reference[True-True-False-1-8-1000-8000-0]",
)
"""Node ids (or their prefix) of the slowest tests of ``make test-fast`` on the 2-core VM (call seconds, measured
2026-11-29): marked ``slow``, so ``make test`` runs them and the inner loop stays under 5 minutes. Each kernel case
here has smaller cases of the same test left in the inner loop."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``SLOW_IN_THE_INNER_LOOP`` slow."""
    for item in items:
        if item.nodeid.startswith(SLOW_IN_THE_INNER_LOOP):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (2 layers, GQA 2) with a byte-level tokenizer, saved with save_pretrained."""
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-a", TinyLlamaSpec(seed=0))


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture as ``tiny_model_dir`` with different weights."""
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-b", TinyLlamaSpec(seed=1))


@pytest.fixture(scope="session")
def endless_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model that never ends an answer with EOS, with a 32k context: long generations."""
    spec = TinyLlamaSpec(seed=0, never_eos=True, max_positions=1 << 15)
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-endless", spec)


@pytest.fixture(scope="session")
def endless_lm(endless_model_dir: Path) -> LoadedModel:
    """``endless_model_dir``, loaded."""
    return load_model(str(endless_model_dir), page_size=TEST_PAGE_SIZE, progress=False)


@pytest.fixture(scope="session")
def lm(tiny_model_dir: Path) -> LoadedModel:
    """The tiny model, loaded through the product's loader."""
    return load_model(str(tiny_model_dir), page_size=TEST_PAGE_SIZE, progress=False)


@pytest.fixture()
def store(tmp_path: Path) -> KVStore:
    """An empty embedded store in a temp dir."""
    s = KVStore(StoreConfig(home=tmp_path / "home", page_size=TEST_PAGE_SIZE))
    yield s
    s.close()


@pytest.fixture()
def worker(store: KVStore, lm: LoadedModel) -> Worker:
    """A worker over ``store`` running the tiny model, with a small prefill chunk to exercise chunking."""
    return Worker(store, lm, chunk_size=40, progress=False)


@pytest.fixture()
def endless_worker(store: KVStore, endless_lm: LoadedModel) -> Worker:
    """A worker over ``store`` whose generations run to max_new_tokens."""
    return Worker(store, endless_lm, progress=False)
