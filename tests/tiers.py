"""The default tier (``pytest -q``, minutes on 2 cores) and the full matrix (``pytest -q
--full``, what CI runs): every guarantee keeps a representative in the default tier, and the
rest of its matrix runs with ``--full``.

``FULL`` names what only ``--full`` runs: a test (every parameter) or one parametrized case,
by node id; ``KEEP`` the cases of those tests the default tier keeps, each the guarantee's
representative. Tests named nowhere run in both tiers (the op against math, the block
geometry's proofs, config and error lines, the launcher's and the support matrix's checks).
"""

FULL = [
    # each mode against world=1: one case per guarantee stays (KEEP)
    "tests/test_attention.py::test_matches_stock_self_attention",
    "tests/test_attention.py::test_several_head_groups_per_call_match_stock_self_attention",
    "tests/test_attention.py::test_saved_for_backward_is_one_over_d",
    "tests/test_attention.py::test_counted_bytes_match_design_formula",
    "tests/test_attention.py::test_tsp_backward_runs_no_attention_forward",
    "tests/test_baselines.py::test_tensor_parallel_matches_single_process",
    "tests/test_baselines.py::test_tp_cp_baseline_with_flash_core_attention_matches",
    "tests/test_baselines.py::test_tp_cp_baseline_matches_on_rope_gqa_swiglu",
    "tests/test_baselines.py::test_ring_mlp_in_tensor_parallel_models_matches_single_process",
    "tests/test_baselines.py::test_ring_mlp_composes_with_pipeline_recompute_and_context_parallelism",
    "tests/test_baselines.py::test_cp_with_fully_sharded_weights_matches_single_process",
    "tests/test_mlp.py::test_matches_stock_mlp",
    "tests/test_mlp.py::test_gathered_shards_match_stock_mlp",
    "tests/test_mlp.py::test_ring_mlp_in_a_tensor_parallel_model_matches_stock_mlp",
    "tests/test_mlp.py::test_overlap_determinism_traffic_and_saved_memory",
    "tests/test_mlp.py::test_a_recomputed_gelu_mlp_keeps_its_activation_and_backward_does_not_run_it",
    "tests/test_gpt.py::test_tsp_trains_like_single_process",
    "tests/test_gpt.py::test_the_mlp_backward_posts_the_attention_backwards_kv",
    "tests/test_gpt.py::test_tsp_with_dp_pp_and_recompute",
    "tests/test_gpt.py::test_table_vocabulary_trains_like_single_process",
    "tests/test_gpt.py::test_the_output_layers_table_travels_during_the_decoder",
    "tests/test_gpt.py::test_softmax_sinks_train_like_single_process",
    "tests/test_gpt.py::test_sliding_windows_train_like_single_process",
    "tests/test_gpt.py::test_packed_documents_train_like_single_process",
    "tests/test_gpt.py::test_sliding_windows_within_packed_documents_train_like_single_process",
    "tests/test_gpt.py::test_moe_trains_like_single_process",
    "tests/test_gpt.py::test_tsp_and_tp_sp_loss_curves_match",
    "tests/test_hybrid.py::test_tsp_hybrid_model_trains_like_the_single_process_one",
    "tests/test_precision.py::test_tsp_bf16_gradients_are_no_less_precise_than_tp_sp",
    # checkpoints between layouts
    "tests/test_checkpoint.py::test_other_layouts_resume",
    "tests/test_checkpoint.py::test_other_checkpoints_load_into_tsp",
    "tests/test_checkpoint.py::test_ring_mlp_checkpoints_move_both_ways",
    "tests/test_checkpoint.py::test_moe_checkpoints_move_between_layouts",
    # the planner against a real step and its formulas; plan and predict
    "tests/test_memory.py::test_planner_matches_a_real_step",
    "tests/test_memory.py::test_the_planner_sees_every_shard_in_flight",
    "tests/test_memory.py::test_per_layer_activations_match_the_formula",
    "tests/test_plan.py::test_bisection_finds_the_boundary",
    "tests/test_plan.py::test_mixture_of_experts_models_may_recompute_their_moe_layers",
    "tests/test_plan.py::test_peak_memory_and_flops_extrapolate_exactly_in_the_layer_count",
    "tests/test_plan.py::test_the_fastest_fitting_choice_is_marked",
    "tests/test_plan.py::test_tsps_calls_are_the_models_choice_where_the_config_leaves_them_to_auto",
    "tests/test_plan.py::test_nothing_fits_on_a_gpu_too_small",
    "tests/test_plan.py::test_a_mixture_of_experts_model_is_planned_with_balanced_routing",
    "tests/test_perfmodel.py::test_layer_extrapolation_matches_a_full_plan",
    "tests/test_perfmodel.py::test_prediction_has_every_mode_and_a_sweep",
    "tests/test_perfmodel.py::test_the_launch_counting_script_counts_a_step",
    # the benchmark, the link and the GPU check's rehearsal
    "tests/test_bench.py::test_modes_agree_on_a_rope_gqa_swiglu_model",
    "tests/test_bench.py::test_the_crossover_rate_is_where_the_ratio_crosses_one",
    "tests/test_link.py",
    "tests/test_gpucheck.py::test_gpu_check_writes_each_part",
    # the main job's resumes and options
    "tests/test_train.py::test_killed_run_resumes_with_the_same_losses",
    "tests/test_train.py::test_d2_checkpoint_resumes_in_other_layouts",
    "tests/test_train.py::test_ring_mlp_in_tp_sp_trains_from_the_same_loss",
    "tests/test_train.py::test_a_resume_with_another_schedule_or_batch_says_so",
    "tests/test_train.py::test_overlap_param_gather_over_several_buckets_trains_as_without_it",
    "tests/test_train.py::test_optimizer_state_of_several_buckets_resumes_exactly_and_in_another_layout",
    "tests/test_train.py::test_a_run_that_needs_many_epochs_of_its_corpus_says_so",
    "tests/test_train.py::test_attention_variants_train_tsp_and_tp_sp_from_the_same_loss",
    "tests/test_train.py::test_cp_with_fully_sharded_weights_trains_from_tsps_first_loss",
    # signals and faults: one of each kind stays
    "tests/test_faults.py::test_a_run_killed_while_saving_resumes_from_the_previous_checkpoint",
    "tests/test_faults.py::test_ctrl_c_exits_130_with_one_line_and_leaves_no_process",
    "tests/test_faults.py::test_sigterm_with_the_exit_signal_handler_saves_and_resumes_exactly",
    "tests/test_faults.py::test_sigterm_while_the_job_starts_saves_after_the_first_step",
    "tests/test_faults.py::test_sigterm_to_every_process_while_checkpoints_are_written_saves_and_exits_0",
    "tests/test_faults.py::test_ctrl_c_then_sigterm_is_still_an_interruption",
    "tests/test_faults.py::test_sigterm_to_torchrun_saves_and_exits_0",
    "tests/test_faults.py::test_sigterm_without_the_handler_ends_every_process_with_one_line",
    "tests/test_launch.py::test_a_launcher_killed_with_sigkill_leaves_no_process",
    # Megatron-LM's pretrain(), each run a torchrun of 2 ranks
    "tests/test_megatron_lm.py::test_tsp_through_pretrain_equals_stock_tp_sp",
    "tests/test_megatron_lm.py::test_table_vocabulary_through_pretrain_equals_stock_tp_sp",
    "tests/test_megatron_lm.py::test_ring_mlp_through_pretrain_equals_stock_tp_sp",
    "tests/test_megatron_lm.py::test_a_load_continues_the_uninterrupted_run",
    "tests/test_megatron_lm.py::test_packed_documents_through_pretrain_equal_stock_tp_sp",
    "tests/test_megatron_lm.py::test_mixture_of_experts_through_pretrain_equals_stock_tp_sp",
    "tests/test_megatron_lm.py::test_attention_variants_through_pretrain_tsp_equal_tp_sp",
    "tests/test_megatron_lm.py::test_fsdp2_through_stock_pretrain_equals_stock_data_parallel",
    "tests/test_megatron_lm.py::test_a_bad_flag_under_torchrun_is_its_line_and_the_rank_that_exited",
    "tests/test_megatron_lm.py::test_rendered_configs_parse_with_megatron_lm",
]

KEEP = [
    "tests/test_attention.py::test_matches_stock_self_attention[4-fp32]",  # D=4: a middle rank
    "tests/test_attention.py::test_several_head_groups_per_call_match_stock_self_attention[4]",
    "tests/test_attention.py::test_saved_for_backward_is_one_over_d[4]",
    "tests/test_attention.py::test_counted_bytes_match_design_formula[4]",
    "tests/test_attention.py::test_tsp_backward_runs_no_attention_forward[4-2]",
    "tests/test_baselines.py::test_tensor_parallel_matches_single_process[tp-2]",
    "tests/test_baselines.py::test_tensor_parallel_matches_single_process[tp-sp-2]",
    "tests/test_baselines.py::test_tp_cp_baseline_matches_on_rope_gqa_swiglu[1-2]",
    "tests/test_baselines.py::test_ring_mlp_in_tensor_parallel_models_matches_single_process[modern-tp-sp-ring]",
    "tests/test_baselines.py::test_cp_with_fully_sharded_weights_matches_single_process[modern-2]",
    "tests/test_mlp.py::test_matches_stock_mlp[4-bf16]",
    "tests/test_mlp.py::test_gathered_shards_match_stock_mlp[4-fp32]",
    "tests/test_mlp.py::test_ring_mlp_in_a_tensor_parallel_model_matches_stock_mlp[tp-ring-fp32]",
    "tests/test_mlp.py::test_overlap_determinism_traffic_and_saved_memory[4]",
    "tests/test_mlp.py::test_a_recomputed_gelu_mlp_keeps_its_activation_and_backward_does_not_run_it[fp32]",
    "tests/test_gpt.py::test_tsp_trains_like_single_process[2-modern]",
    "tests/test_gpt.py::test_the_mlp_backward_posts_the_attention_backwards_kv[full]",
    "tests/test_gpt.py::test_tsp_with_dp_pp_and_recompute[pp2-recompute]",
    "tests/test_gpt.py::test_table_vocabulary_trains_like_single_process[tsp2]",
    "tests/test_gpt.py::test_softmax_sinks_train_like_single_process[tsp2-learnable]",
    "tests/test_gpt.py::test_sliding_windows_within_packed_documents_train_like_single_process[tsp2]",
    "tests/test_gpt.py::test_moe_trains_like_single_process[tsp2-ep2-top2]",
    "tests/test_gpt.py::test_moe_trains_like_single_process[tsp2-ep1-top2]",
    "tests/test_hybrid.py::test_tsp_hybrid_model_trains_like_the_single_process_one[modern]",
    "tests/test_checkpoint.py::test_other_layouts_resume[d1]",
    "tests/test_checkpoint.py::test_moe_checkpoints_move_between_layouts[tsp2-ep2-into-d1]",
    "tests/test_memory.py::test_planner_matches_a_real_step[tsp]",
    "tests/test_memory.py::test_per_layer_activations_match_the_formula[swiglu-gqa-tsp-fused-norm]",
    "tests/test_plan.py::test_peak_memory_and_flops_extrapolate_exactly_in_the_layer_count[tiny-tsp]",
    "tests/test_train.py::test_attention_variants_train_tsp_and_tp_sp_from_the_same_loss[packed-documents]",
]


def names(name: str, nodeid: str) -> bool:
    """Whether ``name`` (a file, a test or one case) names the test ``nodeid``."""
    return nodeid == name or nodeid.startswith(name + "[") or nodeid.startswith(name + "::")


def tier_of(nodeid: str) -> str:
    """``full`` for a test only ``--full`` runs, else ``default``."""
    if nodeid in KEEP:
        return "default"
    return "full" if any(names(name, nodeid) for name in FULL) else "default"
