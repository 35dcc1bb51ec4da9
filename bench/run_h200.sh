#!/usr/bin/env bash
# One device call on an H200 machine (most modes need 2 GPUs). Every step is time-boxed and logged to $OUT;
# a failing step does not stop the others; $OUT comes back as one tgz.
# Usage: bash bench/run_h200.sh phase1|phase2|final|study ...|study124_x4 TOKENS BUDGET|study124 TOKENS ARM:SECONDS,...|study124_bg TOKENS ARM BUDGET [WAIT]|bg_wait ARM [SECONDS]|bg_stop ARM [SECONDS]|realign|lora_next|qroot_shift|qroot_split|root_fb [BUDGET [wa]]|root_fix [BUDGET]|ptq [fragility]|ns_soft|fragility_next|posthoc [ARMS [POLICIES [BUDGET]]]|first_block [FULL [Q2]]|first_block_lora [RANK [BUDGET]]|full_frozen [RANK [BUDGET [EVERY]]]|seeds S[,S..]|- ARM:SECONDS,...|SEED:ARM:SECONDS,... [EXTRA [TAG]]|fork S [AT [ARMS [EXTRA]]]|pdl|verify|fsdp_sweep [MB]|fsdp_optim|dist_cg|attn_ab|attn_step|layout_ab|requant_ab|deq_ab|dkdv_ab|fused_ab|attn_bisect|both_ab|dkdv_contig_ab|decode_ab|qflat_ab|trim_ab|regcap_ab|attn_regcap|s30_ab|attn_stages|s31_next|attn_div_ab|r46_ab|s31_final|attn_caps31|s31_check|s32_c|s32_d|s33_next|s33_b|s33_c|s33_d|s33_e|s34_next|ab ARGS...|s34_final|s35_next|s35_b|s35_final|s36_qk [BUDGET]|s37_next|s38_a|s39_a|s39_b|s39_c|s40_suite|s40_mean|s41_root|s42_ns|s43_sr|s44_glue|s44_shift|s44_next|s45_shared|s45_eden|s46_qadamw|s46_eden|s47_fork|s47_root|s49_qk|s50_qk|s51_qk|s51_fork|s53_qk|s53_b|s54_next|s54_measure|s55_b|ncu|s57_gemm|s58_fused|s58_b|s60_det|s61_fill|gpu_suite [PYTEST ARGS...]
set -u
OUT=${OUT:-bench_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python -m pip install -q -e . --no-deps --no-build-isolation >"$OUT/pip.log" 2>&1 || echo "pip -e failed (see pip.log)"
step() { local name=$1 t=$2; shift 2; local t0=$SECONDS
  timeout "$t" "$@" >"$OUT/$name.log" 2>&1; local rc=$?
  echo "[$name] rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/steps.txt"; }
# the GPT-124M full-stack step (CUDA graphs) of this tree, profiled, against BF16, then of the tree under .ab/old
# (if carried) without the BF16 run: step_ab SECONDS_NEW SECONDS_OLD
step_ab() {
  step step_full_stack "$1" python bench/train_step.py --policy full_stack --modes reduce-overhead --steps 20 \
      --warmup 3 --profile --json "$OUT/train_step.jsonl"
  if [ -d .ab/old/fp4compile ]; then
    ( cd .ab/old && export PYTHONPATH=$PWD && step step_full_stack_old "$2" python bench/train_step.py \
        --policy full_stack --modes reduce-overhead --steps 20 --warmup 3 --skip-bf16 --json "$OUT/train_step_old.jsonl" )
  fi; }
# issues 2 + 3: the MS-EDEN pass-1 GPU test (every e_impl), the sweep SWEEP of bench/quantize.py, its MS-EDEN rows at
# 16384x8192 and 4096x4096 (every e_impl), then the 124M step with each ARM (bench/step_ab.py settings) against the
# default and BF16 Inductor, interleaved in one process: eden_pass1_ab SWEEP ARM...
eden_pass1_ab() {
  local sweep=$1 arms=() a; shift
  for a in "$@"; do arms+=(--arm "$a"); done
  step gpu_tests 150 python -m pytest -m gpu -q -p no:cacheprovider tests/test_quantize_kernels.py -k pass1_variants
  step sweeps 150 python bench/quantize.py --sweep --sweeps "$sweep" --no-eager --out "$OUT/sweeps"
  step reduced 100 python bench/quantize.py --bench --reduced --no-eager --out "$OUT/reduced"
  step step_ab 240 python bench/step_ab.py --rounds 6 --block 10 --json "$OUT/step_ab.jsonl" --arm fp4 "${arms[@]}" \
      --arm bf16:backend=inductor
  grep -h "e_impl\|MS-EDEN" "$OUT/sweeps.log" "$OUT/reduced.log" | head -40; }
# the GPT-124M full-stack step (CUDA graphs, 30 steps, no profiler, no BF16) of this tree and of the tree under
# .ab/cand (or .ab/DIR), alternating twice: step_cand_ab [DIR]
step_cand_ab() {
  local C=$PWD/.ab/${1:-cand}
  for t in main cand main2 cand2; do
    case $t in cand*) P=$C;; *) P=$PWD;; esac
    ( cd "$P" && export PYTHONPATH=$P && step "step_$t" 100 python bench/train_step.py --policy full_stack \
        --modes reduce-overhead --steps 30 --warmup 3 --skip-bf16 --json "$OUT/train_step_$t.jsonl" )
  done; }
# issue 5: the GPU tests of kernels/ns_glue.py and Q-Root, the Q-Root step (bench/optim.py, 124M and 1B sets, CUDA
# graphs) of this tree and of the trees under .ab/old and .ab/mid (carried) in the order of the labels (new*, old*,
# mid*; FP4COMPILE_NS_GLUE=1, so that a tree from before session 44 runs its kernels), then this tree's step by torch
# op: root_trees LABEL...
root_trees() {
  step gpu_tests 200 python -m pytest -m gpu -q -n 4 -rf -p no:cacheprovider tests/test_ns_glue.py \
      tests/test_optim_root.py
  local t P
  for t in "$@"; do
    case $t in old*) P=$PWD/.ab/old;; mid*) P=$PWD/.ab/mid;; *) P=$PWD;; esac
    ( cd "$P" && export PYTHONPATH=$P FP4COMPILE_NS_GLUE=1 && step "root_$t" 90 python bench/optim.py \
        --skip check,adamw,profile,warps,peak --root-sets 124M,1B --out "$OUT/root_$t.json" )
  done
  step root_ops 60 python bench/optim.py --skip check,adamw,profile,warps,peak,root --root-ops 124M
  tail -n 5 "$OUT/gpu_tests.log"; grep -h "^section=QRoot" "$OUT"/root_*.log; }
# bench/attention_kernels_at.py of this tree once per LABEL[=JSON] in the order given (JSON: a --bwd-config override
# for the paper split; none: the default), at SHAPE, each logged as PREFIX_LABEL; MASKS (optional): its --masks:
# [MASKS=M,...] attn_configs PREFIX SHAPE LABEL[=JSON]...
attn_configs() {
  local prefix=$1 shape=$2 a c; shift 2
  for a in "$@"; do
    c=${a#*=}; [ "$c" = "$a" ] && c=''
    PYTHONPATH=$PWD step "${prefix}_${a%%=*}" 60 python bench/attention_kernels_at.py --label "${a%%=*}" \
        --shape "$shape" ${c:+--bwd-config "$c"} ${MASKS:+--masks "$MASKS"}
  done; }
# the 124M step with Q, K in 1x16 blocks (QK_BLOCKS="1x16") against the tiles, alone on the GPU (ROUNDS rounds of
# 10 steps), and with "none" also 1x16 without the Q, K transform, with "all" the tiles without it as well:
# qk1x16_ab SECONDS ROUNDS [none|all]
qk1x16_ab() {
  local arms=(--arm 'qk1x16:fp4compile.passes.attention.QK_BLOCKS="1x16"')
  [ "${3:-}" = all ] && arms+=(--arm 'fp4none:fp4compile.passes.attention.QK_TRANSFORM="none"')
  [ -n "${3:-}" ] && arms+=(--arm \
      'qk1x16none:fp4compile.passes.attention.QK_BLOCKS="1x16",fp4compile.passes.attention.QK_TRANSFORM="none"')
  step step_ab "$1" python bench/step_ab.py --rounds "$2" --block 10 --json "$OUT/step_ab.jsonl" --arm fp4 "${arms[@]}"
  tail -n 5 "$OUT/step_ab.log"; }
# every GPU test of the Q-Attn file and the non-finite input tests (session 52), FILES in the order given, for at
# most SECONDS: qattn_finite_tests SECONDS FILE...
qattn_finite_tests() {
  local t=$1; shift
  step gpu_tests "$t" python -m pytest -m gpu -q -p no:cacheprovider "$@" -k "not test_quantize_kernels or nonfinite"
  tail -n 15 "$OUT/gpu_tests.log"; }
# Nsight Compute's counters for each WORKLOAD of bench/ncu_kernels.py (default: $NCU_WORKLOADS, else all seven;
# issues 2 to 5; sessions 55, 56): the raw CSV in $OUT/ncu_WORKLOAD.log, its summary in $OUT/ncu_WORKLOAD.md. The stall
# reasons are named metrics: if ncu refuses one (==ERROR==), the workload runs again with the sections alone
# (ncu_WORKLOAD_sections.log): ncu_probe SECONDS [WORKLOAD...]
ncu_probe() {
  local t=$1 w ncu stalls r log; shift
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
  [ -n "$ncu" ] || { echo "ncu not found" | tee -a "$OUT/steps.txt"; return; }
  local sections=(--clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy
      --section LaunchStats --section WarpStateStats --section SchedulerStats --page raw --csv)
  stalls=""; for r in long_scoreboard short_scoreboard wait barrier mio_throttle lg_throttle math_pipe_throttle \
      not_selected selected no_instruction dispatch_stall branch_resolving membar sleeping tex_throttle drain imc_miss; do
    stalls+="smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio,"; done
  [ $# -gt 0 ] || set -- ${NCU_WORKLOADS:-attn_paper attn_paper1x16 eden rtn qadamw adamw gemm124}
  for w in "$@"; do
    log=ncu_$w
    step "$log" "$t" "$ncu" "${sections[@]}" \
        --metrics "${stalls}smsp__average_warp_latency_per_inst_issued.ratio,smsp__inst_executed.sum" \
        python bench/ncu_kernels.py "$w"
    if grep -q "==ERROR==" "$OUT/$log.log"; then
      grep -h "==ERROR==" "$OUT/$log.log" | head -n 3
      log=ncu_${w}_sections; step "$log" "$t" "$ncu" "${sections[@]}" python bench/ncu_kernels.py "$w"
    fi
    python bench/ncu_kernels.py --summarize "$OUT/$log.log" > "$OUT/ncu_$w.md" 2>&1; cat "$OUT/ncu_$w.md"
    grep -h "==ERROR==\|==WARNING==" "$OUT/$log.log" | head -n 5
  done; }
# the bench/study.py command of issue 7's arm(s) ARMS ("+" joins a --pair-late pair) at TOKENS with a time budget of
# SECONDS into the global array study_argv, the folder of its arms' run directories (--out DIR/SIZE) into study_dir,
# its log name into study_name and its export folder, PARENT/study_name, into study_export. SIZE (default 124m) and
# SEED as in the study124 mode below:
# study_cmd TOKENS ARMS SECONDS PARENT
study_cmd() {
  local tokens=$1 size=${SIZE:-124m} dir=.study124 seed=${SEED:-} tag=study124
  [ "$size" = 124m ] || { tag=study$size; dir=.study${size}_$tokens; }
  # 124M runs of another length than session 15's 100e6 get their own directories (a warm machine would resume them)
  [ "$size" = 124m ] && [ "$tokens" != 100e6 ] && dir=.study124_$tokens
  local extra=(); [ -n "$seed" ] && { tag+=_seed$seed; dir+=_seed$seed; extra=(-- --seed "$seed"); }
  study_dir=$dir/$size study_name=${tag}_${2//+/_}; study_export=$4/$study_name
  study_argv=(python bench/study.py --size "$size" --arms "${2//+/,}" --pair-late --out "$dir" --tokens "$tokens"
      --skip-data --time-budget "$3" --export "$study_export" "${extra[@]}"); }
# issue 7's study arms one after another (the study124 mode below): study124_run TOKENS ARM:SECONDS,...
study124_run() {
  local tokens=$1 par=${PAR:-0}
  step data 60 python bench/study.py --data-only
  local ab a b; for ab in ${2//,/ }; do a=${ab%%:*}; b=${ab##*:}
    study_cmd "$tokens" "$a" "$b" "$OUT"
    run_arm() { step "$study_name" $((b + 15)) "${study_argv[@]}"; }
    if [ "$par" = 1 ]; then run_arm & else run_arm; fi
  done
  wait; }
# waits up to $2 s for the study124_bg run of arm $1 (below); once it ended, its log and --export folder go to $OUT
bg_wait() {
  local d=${BG_DIR:-/tmp/bg}/study124_$1
  bash bench/bg.sh wait "study124_$1" "$2" "$(cat "$d/watch" 2>/dev/null)" | tee -a "$OUT/bg_wait_$1.txt"
  if [ "${PIPESTATUS[0]}" != 3 ]; then
    cp "$d/log" "$OUT/study124_$1_bg.log" 2>/dev/null; cp -r "$(cat "$d/export" 2>/dev/null)" "$OUT/" 2>/dev/null
  fi; return 0; }
s54_measure() {  # s54_next's measurements (below)
  qk1x16_ab 240 6 all
  MASKS=paper,paper1x16 attn_configs attn_kernels 16,12,1024,64 default
  MASKS=paper1x16 attn_configs attn_kernels 16,12,1024,64 'dq1stage={"dq": {"num_stages": 1}}' \
      'dq128={"dq": {"BM": 128, "num_warps": 8}}'
  grep -h '^[|#]' "$OUT"/attn_kernels*.log
  step gpu_finite 100 python -m pytest -m gpu -q -p no:cacheprovider tests/test_finite.py; tail -n 3 "$OUT/gpu_finite.log"
}
case "${1:-phase1}" in
phase1)
  nvidia-smi -L; python -c "import torch, triton; print(torch.__version__, triton.__version__)"
  ( export CUDA_VISIBLE_DEVICES=0
    step train_step 230 python bench/train_step.py --policy quartet2 --steps 10 --json "$OUT/train_step.jsonl"
    step optim 170 python bench/optim.py --out "$OUT/optim.json" ) &
  ( export CUDA_VISIBLE_DEVICES=1
    step gpu_tests 150 python -m pytest -m gpu -q -x -p no:cacheprovider tests/test_quantize_kernels.py \
        tests/test_backend.py tests/test_attention.py tests/test_optim_qadamw.py tests/test_optim_root.py
    step attention 90 python bench/attention.py --quick --skip-check --out "$OUT"
    step dist_1gpu 160 python bench/distributed.py --model 124m --parallel none --json "$OUT/dist_none.json" ) &
  wait ;;
phase2)
  step dist_ddp 160 torchrun --nproc-per-node 2 bench/distributed.py --model 124m --parallel ddp --json "$OUT/dist_ddp.json"
  step dist_fsdp2 160 torchrun --nproc-per-node 2 bench/distributed.py --model 124m --parallel fsdp2 --json "$OUT/dist_fsdp2.json" ;;
final)
  # the whole measurement of main on an nvidia-h200-x2: GPU tests, the benchmarks, FSDP2 and DDP (~7 minutes;
  # the attention table is not re-run: bench/attention.py --phase table separately)
  nvidia-smi -L; python -c "import torch, triton; print(torch.__version__, triton.__version__)"
  ( export CUDA_VISIBLE_DEVICES=0
    step train_step 250 python bench/train_step.py --steps 10 --warmup 3 --profile --json "$OUT/train_step.jsonl"
    step host_overhead 30 python bench/host_overhead.py
    step dist_1gpu 90 python bench/distributed.py --model 124m --parallel none --json "$OUT/dist_none.json" ) &
  ( export CUDA_VISIBLE_DEVICES=1
    step gpu_tests 180 python -m pytest -m gpu -q -n 8 -p no:cacheprovider tests/ --deselect tests/test_attention.py
    step quantize 60 python bench/quantize.py --bench --quick --out "$OUT"
    step optim 130 python bench/optim.py --out "$OUT/optim.json"
    step attention_tests 100 python -m pytest -m gpu -x -q -p no:cacheprovider tests/test_attention.py ) &
  wait
  step dist_fsdp2 110 torchrun --nproc-per-node 2 bench/distributed.py --model 124m --parallel fsdp2 --json "$OUT/dist_fsdp2.json"
  step dist_ddp 120 torchrun --nproc-per-node 2 bench/distributed.py --model 124m --parallel ddp --json "$OUT/dist_ddp.json"
  cat "$OUT/steps.txt"
  for f in "$OUT"/*.log; do echo "=== $(basename "$f")"; tail -n 12 "$f"; done 2>/dev/null | tail -c 10000
  # the device returns at most 8 files: pack everything into one
  ( cd "$OUT" && tar czf /tmp/final.tgz . && find . -mindepth 1 -delete && mv /tmp/final.tgz . )
  exit 0 ;;
study)
  # one call of the 30M quality study (docs/RESULTS.md) on an nvidia-h200-x2, carry [".data/corpus",
  # ".data/gpt2.tiktoken"]: bash bench/run_h200.sh study ARMS_GPU0 ARMS_GPU1 TOKENS BUDGET_S [tests]
  # (arms comma-separated; the same command again, while the machine is warm, continues every arm;
  # SIZE=124m for the 124M study, e.g. three back-to-back calls of
  # SIZE=124m bash bench/run_h200.sh study full bf16root 300e6 570 = a whole session's device time)
  arms0=$2 arms1=$3 tokens=$4 budget=$5 size=${SIZE:-30m}
  step data 150 python bench/study.py --data-only
  ( export CUDA_VISIBLE_DEVICES=0
    if [ "${6:-}" = tests ]; then
      step cg_tests 200 python -m pytest -m gpu -q -p no:cacheprovider tests/test_train_loop.py tests/test_backend.py
    fi
    step study_gpu0 $((budget - SECONDS)) python bench/study.py --size "$size" --arms "$arms0" --tokens "$tokens" \
        --skip-data --time-budget $((budget - SECONDS - 20)) ) &
  ( export CUDA_VISIBLE_DEVICES=1
    step study_gpu1 $((budget - SECONDS)) python bench/study.py --size "$size" --arms "$arms1" --tokens "$tokens" \
        --skip-data --time-budget $((budget - SECONDS - 20)) ) &
  wait
  python bench/study.py --size "$size" --tokens "$tokens" --report --export "$OUT/study" ;;
study124_x4)
  # issue 7's 124M comparison on an nvidia-h200-x4 (not lent so far): bash bench/run_h200.sh study124_x4 TOKENS
  # BUDGET_S, e.g. three back-to-back calls of "study124_x4 500e6 570" (a whole session; carry .data/corpus,
  # .data/gpt2.tiktoken; .study/ stays on the warm machine). GPUs 0-1: the default full stack (fullbest, as in the
  # 30M study and study124_x8) under DDP (bench/study.py --nproc 2: 32 sequences per rank, the same global batch);
  # GPU 2: bf16root (the optimizer-matched BF16 run); GPU 3: BF16 with AdamW. Estimated from docs/BENCHMARKS.md's
  # 124M rates: ~20 min for the full stack at 500M tokens, ~16-17 for each BF16 arm
  tokens=$2 budget=$3
  step data 150 python bench/study.py --data-only
  ( export CUDA_VISIBLE_DEVICES=0,1
    step study124_fullbest $((budget - SECONDS)) python bench/study.py --size 124m --arms fullbest --nproc 2 \
        --tokens "$tokens" --skip-data --time-budget $((budget - SECONDS - 20)) ) &
  ( export CUDA_VISIBLE_DEVICES=2
    step study124_bf16root $((budget - SECONDS)) python bench/study.py --size 124m --arms bf16root \
        --tokens "$tokens" --skip-data --time-budget $((budget - SECONDS - 20)) ) &
  ( export CUDA_VISIBLE_DEVICES=3
    step study124_bf16 $((budget - SECONDS)) python bench/study.py --size 124m --arms bf16 \
        --tokens "$tokens" --skip-data --time-budget $((budget - SECONDS - 20)) ) &
  wait
  python bench/study.py --size 124m --arms bf16,bf16root,fullbest --tokens "$tokens" --report \
      --export "$OUT/study124" ;;
study124_x8)
  # issue 7's 124M target (<= 1.0 % at >= 500M tokens) on an nvidia-h100-x8 / nvidia-h200-x8 (session 54; not lent
  # so far): bash bench/run_h200.sh study124_x8 TOKENS BUDGET_S, e.g. "study124_x8 500e6 570" in back-to-back calls
  # on the warm machine until every arm is done (carry .data/corpus, .data/gpt2.tiktoken; .study/ stays on it; each
  # call resumes the arms from their checkpoints). GPUs 0-3: fullbest, the default (Q, K in 1x16 blocks since
  # session 61; bench/study.py --nproc 4, DDP, 16 sequences per rank, the same global batch); GPUs 4-5: bf16root;
  # GPUs 6-7: fullbest_qk16x16 (the tiles, the default until session 60). From the 124M rates of sessions 15-16
  # (bf16root 466k tokens/s, the full stack 229k on one GPU) and ~0.9 DDP scaling: ~10 min for bf16root, ~20 for
  # the tiles, ~10 for the default at 500M tokens
  tokens=$2 budget=$3
  step data 150 python bench/study.py --data-only
  x8_arm() {   # x8_arm GPUS ARM NPROC PORT
    ( export CUDA_VISIBLE_DEVICES=$1
      step "study124_$2" $((budget - SECONDS)) python bench/study.py --size 124m --arms "$2" --nproc "$3" \
          --master-port "$4" --tokens "$tokens" --skip-data --time-budget $((budget - SECONDS - 20)) ) & }
  x8_arm 0,1,2,3 fullbest 4 29500
  x8_arm 4,5 bf16root 2 29510
  x8_arm 6,7 fullbest_qk16x16 2 29520
  wait
  python bench/study.py --size 124m --arms bf16root,fullbest,fullbest_qk16x16 --tokens "$tokens" --report \
      --export "$OUT/study124" ;;
study124)
  # issue 7's 124M comparison on one nvidia-h200 (carry .data/corpus, .data/gpt2.tiktoken): arms one after another,
  # each with its own time budget; the same command again on a warm machine continues them (.study124/ stays on
  # it). bash bench/run_h200.sh study124 TOKENS ARM:SECONDS,...; session 15: "study124 100e6
  # bf16root:330,fullbest:215", then "study124 100e6 fullbest:560" until fullbest is done. Arms joined by "+"
  # share one budget and run as a --pair-late pair ("fullbest+fullbest_late:560": the late arm starts from
  # fullbest's checkpoint at its switch step). SIZE=30m runs the 30M study the same way (run directories in
  # .study30m_TOKENS/), e.g. the 30M arms at the issue's 300M tokens in one session (~22 minutes of training):
  # SIZE=30m ... study124 300e6 bf16root:425,fullbest+fullbest_late+fullbest_late_all:130, then twice
  # ... fullbest+fullbest_late+fullbest_late_all:570 while the machine is warm (docs/RESULTS.md, session 16). Session 17
  # ran that: bf16root:425 ended 27 steps short (give it 445), fullbest took 0.157 s/step (~720 s for 4,577 steps), so
  # one late arm fits and two do not; a nearly finished arm now starts with less than 120 s (bench/study.py start_need)
  # SEED=S (session 19) trains seed S into its own run directories (.study..._seedS); PAR=1 runs the ARM:SECONDS
  # items at the same time on the one GPU (time-sliced: their tokens/s are not a measurement), e.g. session 19's
  # SIZE=30m SEED=1 PAR=1 ... study124 300e6 bf16root:540,fullbest+fullbest_late:540
  study124_run "$2" "$3" ;;
study124_bg)
  # one 124M arm trained by one detached process over several calls (bench/bg.sh: no start-up per call, a time
  # budget longer than a call): bash bench/run_h200.sh study124_bg TOKENS ARM BUDGET [WAIT] starts it (same run
  # directory as study124 TOKENS ARM:..., so either continues the other) and waits WAIT seconds (default 540);
  # then "bg_wait ARM SECONDS" in each next call, fired at once (the machine's idle release is 30 s and giving it
  # back ends the run uncheckpointed), until it reports done; the arm stops and checkpoints by BUDGET itself. Two
  # arms may run at once (each its own process, time-sliced on the one GPU: their tokens/s are then no measurement)
  tokens=$2 arm=$3 bg=${BG_DIR:-/tmp/bg}/study124_$3
  step data 60 python bench/study.py --data-only
  study_cmd "$tokens" "$arm" "$4" "${BG_DIR:-/tmp/bg}/export"; rm -rf "$study_export"
  bash bench/bg.sh start "study124_$arm" -- "${study_argv[@]}"
  echo "$study_dir/$arm/metrics.jsonl" > "$bg/watch"; echo "$study_export" > "$bg/export"
  bg_wait "$arm" "${5:-540}" ;;
bg_wait)
  # the next wait for study124_bg's arm (above): bash bench/run_h200.sh bg_wait ARM [SECONDS]
  bg_wait "$2" "${3:-540}" ;;
bg_stop)
  # stop study124_bg's arm before its budget (when the session's device time runs shorter than planned): bash
  # bench/run_h200.sh bg_stop ARM [SECONDS] puts STOP in its run directory (study.py's --stop-file: the run
  # checkpoints after its current step and study.py exports it), then waits as bg_wait does
  watch=${BG_DIR:-/tmp/bg}/study124_$2/watch
  [ -s "$watch" ] || { echo "bg_stop: no study124_bg run of $2 on this machine ($watch missing)" >&2; exit 1; }
  touch "$(dirname "$(cat "$watch")")/STOP"; bg_wait "$2" "${3:-540}" ;;
realign)
  # issue 6 in one call on an nvidia-h200-x2 (~8 min; carry .data/corpus, .data/gpt2.tiktoken). GPU 0: the 30M
  # LoRA-SVD arm realigning every 300 steps (compare with docs/RESULTS.md's quartet2 / lora rows: same seed and
  # data order); GPU 1: the same arm realigning every 100 steps, then the attention GPU tests
  step data 60 python bench/study.py --data-only
  ( export CUDA_VISIBLE_DEVICES=0
    step lora_realign 480 python bench/study.py --size 30m --arms lora --out .study_realign --tokens 100e6 \
        --skip-data --time-budget 470 --export "$OUT/realign" -- --lora-realign-every 300 ) &
  ( export CUDA_VISIBLE_DEVICES=1
    step lora_realign100 410 python bench/study.py --size 30m --arms lora --out .study_realign100 --tokens 100e6 \
        --skip-data --time-budget 400 --export "$OUT/realign100" -- --lora-realign-every 100
    step attention_tests 140 python -m pytest -m gpu -x -q -p no:cacheprovider tests/test_attention.py ) &
  wait ;;
lora_next)
  # the next LoRA-SVD and noise arms, one call on an nvidia-h200-x2 (~8 min; carry .data/corpus,
  # .data/gpt2.tiktoken). GPU 0: realign every 300 with the factors' moments reset instead of remapped,
  # then realign every 300 from step 600 on. GPU 1: BF16 and NVFP4-linear arms with seed 1: the seed noise
  # of the gap, against which the LoRA differences (0.1 point) have to be read
  step data 60 python bench/study.py --data-only
  ( export CUDA_VISIBLE_DEVICES=0
    step lora_reset 270 python bench/study.py --size 30m --arms lora --out .study_lora_reset --tokens 100e6 \
        --skip-data --time-budget 265 --export "$OUT/lora_reset" -- --lora-realign-every 300 --lora-state-remap reset
    step lora_after 270 python bench/study.py --size 30m --arms lora --out .study_lora_after --tokens 100e6 \
        --skip-data --time-budget 265 --export "$OUT/lora_after" -- --lora-realign-every 300 --lora-realign-after 600
  ) &
  ( export CUDA_VISIBLE_DEVICES=1
    step seed1 520 python bench/study.py --size 30m --arms bf16,quartet2 --out .study_seed1 --tokens 100e6 \
        --skip-data --time-budget 510 --export "$OUT/seed1" -- --seed 1 ) &
  wait ;;
qroot_shift)
  # issue 7 with the identity-shifted NVFP4 NS (QRoot's ns_shift, default since session 6), one call on an
  # nvidia-h200-x2 (~10 min; carry .data/corpus, .data/gpt2.tiktoken; run the same command again while warm to
  # finish what the time budget stopped). GPU 0: the Q-Root GPU tests, then the full stack, seed 0 (compare with
  # RESULTS.md's qroot and bf16root rows). GPU 1: seed 1 of bf16root and the full stack (the seed noise of the gap)
  step data 60 python bench/study.py --data-only
  ( export CUDA_VISIBLE_DEVICES=0
    step gpu_tests_root 90 python -m pytest -m gpu -q -x -p no:cacheprovider tests/test_optim_root.py
    step qroot_shift 480 python bench/study.py --size 30m --arms qroot --out .study_qroot_shift --tokens 100e6 \
        --skip-data --time-budget 470 --export "$OUT/qroot_shift" ) &
  ( export CUDA_VISIBLE_DEVICES=1
    step seed1_root 570 python bench/study.py --size 30m --arms bf16root,qroot --out .study_seed1_root --tokens 100e6 \
        --skip-data --time-budget 560 --export "$OUT/seed1_root" -- --seed 1 ) &
  wait ;;
qroot_split)
  # where the full stack's gap to bf16root comes from, one call on an nvidia-h200-x2 (~6 min; carry
  # .data/corpus, .data/gpt2.tiktoken), seed 0: GPU 0 the full stack with Q-Root's NS in BF16
  # (configs/policy_full_stack_bf16ns.toml), GPU 1 NVFP4 linears alone (quartet2) under ROOT with BF16 NS + AdamW
  step data 60 python bench/study.py --data-only
  ( export CUDA_VISIBLE_DEVICES=0
    step fullstack_bf16ns 540 python bench/study.py --size 30m --arms qroot --out .study_fs_bf16ns --tokens 100e6 \
        --skip-data --time-budget 530 --export "$OUT/fullstack_bf16ns" -- --policy configs/policy_full_stack_bf16ns.toml ) &
  ( export CUDA_VISIBLE_DEVICES=1
    step quartet2_root 540 python bench/study.py --size 30m --arms bf16root --out .study_q2_root --tokens 100e6 \
        --skip-data --time-budget 530 --export "$OUT/quartet2_root" -- --backend fullstack_fp4 --policy quartet2 ) &
  wait ;;
root_fb)
  # NVFP4 linears under ROOT: forward-only vs backward-only NVFP4 (configs/policy_quartet2_{fwd,bwd}_only.toml),
  # seed 0, one call on an nvidia-h200-x2; BUDGET seconds per arm (default 530; compare the gap along the run
  # with RESULTS.md's quartet2 + ROOT row, +2.42 / +2.27 / +3.26 / +3.42 % at steps 400 / 800 / 1,200 / 1,525)
  # ("root_fb BUDGET wa": the forward's weight-only vs activation-only NVFP4 instead, configs/policy_quartet2_
  # fwd_{weight,activation}_only.toml, on GPU 0 / GPU 1)
  b=${2:-530}
  halves=(fwd bwd); [ "${3:-}" = wa ] && halves=(fwd_weight fwd_activation)
  step data 60 python bench/study.py --data-only
  for half in "${halves[@]}"; do
    ( [ $half = "${halves[0]}" ] && export CUDA_VISIBLE_DEVICES=0 || export CUDA_VISIBLE_DEVICES=1
      [ "$half" = fwd_weight ] && step gpu_tests_one_operand 120 python -m pytest -m gpu -q -x -p no:cacheprovider \
          tests/test_backend.py -k one_operand
      step "root_$half" $((b + 20)) python bench/study.py --size 30m --arms bf16root --out ".study_root_$half" \
          --tokens 100e6 --skip-data --time-budget "$b" --export "$OUT/root_$half" -- --backend fullstack_fp4 \
          --policy "configs/policy_quartet2_${half}_only.toml" ) &
  done
  wait ;;
root_fix)
  # candidate fixes for NVFP4 linears under ROOT, seed 0, 100M tokens, one call on an nvidia-h200-x2 (session 7):
  # three arms at a time on each GPU (each arm's own process), BUDGET seconds each (default 500); compare with
  # bf16root (RESULTS.md §1: train 2.2123). Measured: sharing a GPU made each arm ~3x slower (a 30M step
  # already fills an H200), so with 500 s the arms stop at steps ~850-1,000 of 1,525
  b=${2:-500}
  q2=(-- --backend fullstack_fp4 --policy)
  arms0=("q2_fwd_rht:configs/policy_quartet2_fwd_rht.toml" "q2_last_bf16:configs/policy_quartet2_last_block_bf16.toml"
         "q2_mlr1e-3:quartet2 --matrix-lr 1e-3")
  arms1=("bf16root_mlr1e-3:bf16 --backend inductor --matrix-lr 1e-3" "full_fwd_rht:configs/policy_full_stack_fwd_rht.toml"
         "q2_fwd_rht16:configs/policy_quartet2_fwd_rht16.toml")
  step data 60 python bench/study.py --data-only
  run_arm() { local gpu=$1 name=${2%%:*} rest=${2#*:}
    CUDA_VISIBLE_DEVICES=$gpu step "fix_$name" $((b + 40)) python bench/study.py --size 30m --arms bf16root \
        --out ".study_fix_$name" --tokens 100e6 --skip-data --time-budget "$b" --export "$OUT/fix_$name" \
        "${q2[@]}" $rest; }
  for a in "${arms0[@]}"; do run_arm 0 "$a" & done
  for a in "${arms1[@]}"; do run_arm 1 "$a" & done
  wait ;;
ptq)
  # is a ROOT-trained model more fragile under an NVFP4 forward than an AdamW-trained one? (session 7; ~5 min on
  # an nvidia-h200-x2): train bf16root (GPU 0) and bf16 (GPU 1), 30M / 100M tokens, seed 0, then evaluate each
  # final checkpoint post hoc with bench/ptq_eval.py (BF16, NVFP4 forward, weight-only, activation-only);
  # "ptq fragility": bench/root_fragility.py instead (per-layer errors, sensitivities, same-norm noise)
  step data 60 python bench/study.py --data-only
  i=0
  for arm in bf16root bf16; do
    ( export CUDA_VISIBLE_DEVICES=$i
      step "ptq_train_$arm" 280 python bench/study.py --size 30m --arms $arm --out .study_ptq --tokens 100e6 \
          --skip-data --time-budget 260 --export "$OUT/ptq_$arm"
      if [ "${2:-}" = fragility ]; then
        step "fragility_$arm" 240 python bench/root_fragility.py ".study_ptq/30m/$arm" --json "$OUT/fragility_$arm.json"
      else
        step "ptq_eval_$arm" 240 python bench/ptq_eval.py ".study_ptq/30m/$arm" --json "$OUT/ptq.jsonl"
      fi ) &
    i=$((i + 1))
  done
  wait ;;
ns_soft)
  # does a softer orthogonalization (fewer NS steps: the weak singular directions are not raised all the way to
  # 1) leave ROOT-trained weights less fragile under an NVFP4 forward? (session 7; ~5 min on an nvidia-h200-x2)
  # 60M tokens, seed 0: GPU 0 trains bf16root with 5 and 2 NS steps, then root_fragility.py on both; GPU 1
  # trains NVFP4 linears (quartet2) + ROOT with 5 and 2 NS steps (these two stop at steps ~600-700 of 915)
  step data 60 python bench/study.py --data-only
  for gpu in 0 1; do
    ( export CUDA_VISIBLE_DEVICES=$gpu
      for ns in 5 2; do
        extra=(--ns-steps $ns); [ $gpu = 1 ] && extra+=(--backend fullstack_fp4 --policy quartet2)
        step "ns${ns}_gpu$gpu" 180 python bench/study.py --size 30m --arms bf16root --out ".study_ns${ns}_gpu$gpu" \
            --tokens 60e6 --skip-data --time-budget 170 --export "$OUT/ns${ns}_gpu$gpu" -- "${extra[@]}"
      done
      [ $gpu = 0 ] && step fragility_ns 60 python bench/root_fragility.py .study_ns5_gpu0/30m/bf16root \
          .study_ns2_gpu0/30m/bf16root --json "$OUT/fragility_ns.json" ) &
  done
  wait ;;
fragility_next)
  # planned for session 8 (~7 min on an nvidia-h200-x2): bench/root_fragility.py on models trained *in* NVFP4:
  # GPU 0 the study's quartet2 arm (AdamW), then NVFP4 linears under ROOT; GPU 1 the lora arm (does the BF16
  # branch cut the output error: res, eYw?). 30M, 100M tokens, seed 0.
  step data 60 python bench/study.py --data-only
  frag() { step "fragility_$1" 60 python bench/root_fragility.py ".study_frag/30m/$2" --json "$OUT/fragility_$1.json"; }
  ( export CUDA_VISIBLE_DEVICES=0
    step train_quartet2 230 python bench/study.py --size 30m --arms quartet2 --out .study_frag --tokens 100e6 \
        --skip-data --time-budget 220 --export "$OUT/frag_quartet2"
    frag quartet2 quartet2
    step train_q2root 230 python bench/study.py --size 30m --arms bf16root --out .study_frag_root --tokens 100e6 \
        --skip-data --time-budget 220 --export "$OUT/frag_q2root" -- --backend fullstack_fp4 --policy quartet2
    step fragility_q2root 60 python bench/root_fragility.py .study_frag_root/30m/bf16root \
        --json "$OUT/fragility_q2root.json" ) &
  ( export CUDA_VISIBLE_DEVICES=1
    step train_lora 260 python bench/study.py --size 30m --arms lora --out .study_frag --tokens 100e6 \
        --skip-data --time-budget 250 --export "$OUT/frag_lora"
    frag lora lora ) &
  wait ;;
posthoc)
  # session 8, one nvidia-h200 (~9 min): train bf16root, then bf16 (30M, 100M tokens, seed 0, one after the
  # other), and evaluate each final checkpoint post hoc (bench/ptq_eval.py): NVFP4 forward everywhere, with
  # block 0 in BF16, and with every hidden linear split into a BF16 top-32 / top-128 SVD branch + NVFP4 residual
  # ("posthoc ARMS POLICIES BUDGET": other arms / ptq_eval policies, comma lists; BUDGET seconds of training per
  # arm, default 170, which stops the arms at steps ~1,000-1,400 of 1,525; ~215 finishes bf16root). The
  # evaluation gets 30 s + 20 s per policy. Session 9's sweep, one call: posthoc bf16root POLICIES 215 with
  # e.g. bf16,quartet2,quartet2@r128,quartet2@r256,configs/policy_quartet2_first_block_bf16.toml@r128
  pols=bf16,quartet2,configs/policy_quartet2_first_block_bf16.toml,configs/policy_quartet2_last_block_bf16.toml
  pols=${3:-$pols,bf16@r32,quartet2@r32,quartet2@r128}
  b=${4:-170}; te=$((30 + 20 * $(echo "$pols" | tr , '\n' | wc -l)))
  step data 60 python bench/study.py --data-only
  for arm in $(echo "${2:-bf16root,bf16}" | tr , ' '); do
    step "ptq_train_$arm" $((b + 5)) python bench/study.py --size 30m --arms $arm --out .study_ptq --tokens 100e6 \
        --skip-data --time-budget "$b" --export "$OUT/ptq_$arm"
    step "ptq_eval_$arm" "$te" python bench/ptq_eval.py ".study_ptq/30m/$arm" --policies "$pols" --json "$OUT/ptq.jsonl"
  done ;;
first_block)
  # session 8, one nvidia-h200 (~9.5 min): block 0 in BF16 (the ROOT model's most fragile block, bench/
  # root_fragility.py and ptq_eval.py) for the full stack, then for NVFP4 linears under ROOT; 30M, 100M tokens,
  # seed 0; compare with bf16root (train 2.2123) and RESULTS.md's full-stack (+4.8 %) and quartet2 + ROOT rows
  # (+2.42 / +2.27 / +3.26 / +3.42 % at steps 400 / 800 / 1,200 / 1,525). "first_block FULL Q2": budgets (s)
  bf=${2:-360}; bq=${3:-180}
  step data 60 python bench/study.py --data-only
  step fb_full $((bf + 15)) python bench/study.py --size 30m --arms full --out .study_fb_full --tokens 100e6 \
      --skip-data --time-budget "$bf" --export "$OUT/fb_full" -- --policy configs/policy_full_stack_first_block_bf16.toml
  step fb_q2root $((bq + 15)) python bench/study.py --size 30m --arms bf16root --out .study_fb_q2 --tokens 100e6 \
      --skip-data --time-budget "$bq" --export "$OUT/fb_q2root" -- --backend fullstack_fp4 \
      --policy configs/policy_quartet2_first_block_bf16.toml ;;
seeds)
  # issue 6's seed noise (one nvidia-h200): seed S, arms run one after another, each with its own time budget
  # ("arm:seconds", comma-separated); LoRA-SVD realigns every 300 steps from step 600 (session 6's best).
  # EXTRA: more train flags (quoted, e.g. "--lora-realign-scale hold"); TAG names their run directories, so a
  # warm machine does not resume another variant's checkpoint. Several seeds in one call: S may be a comma
  # list of seeds (each runs every arm), or give "seed:arm:seconds" items: seeds - 0:lora:265,3:bf16:215
  extra=${4:-}; tag=${5:-}; items=${3//,/ }
  if [ "$2" != - ]; then items=""; for s in ${2//,/ }; do for ab in ${3//,/ }; do items+="$s:$ab "; done; done; fi
  step data 60 python bench/study.py --data-only
  for it in $items; do s=${it%%:*}; ab=${it#*:}; a=${ab%%:*}; b=${ab##*:}
    # shellcheck disable=SC2086  # EXTRA is a list of flags
    step "seed${s}_$a$tag" $((b + 15)) python bench/study.py --size 30m --arms "$a" --out ".study_seed$s$tag" \
        --tokens 100e6 --skip-data --time-budget "$b" --export "$OUT/seed${s}_$a$tag" -- --seed "$s" \
        --lora-realign-every 300 --lora-realign-after 600 $extra
  done ;;
fork)
  # issue 6 with the early phase's spread shared (one nvidia-h200, ~7 min per seed): seed S's BF16 run to step AT
  # (default 800), then the BF16 run goes on and every other arm (default quartet2,lora) starts from its step-AT
  # checkpoint (fp4compile train --init-from), so the arms differ only after AT. Carry the data (as for seeds).
  # bash bench/run_h200.sh fork S [AT [ARMS [EXTRA]]]; the same command again on a warm machine continues (.fork*
  # is git-ignored since session 11: untracked paths are removed on the machine at each call). Issue 6's next
  # question, how much of the gap a BF16 weight branch can reach and how much rank reaches it:
  # fork S 800 quartet2,q2w,lora128 (~8.5 min; every fork source needs its own BF16 and NVFP4 runs), then at
  # once, while the machine is warm, fork S 800 lora64 adds rank 64 to the same fork (~2.5 min)
  # FORK_SRC: the source arm (default bf16; bf16qroot for QRoot arms: a fork keeps the source's optimizer state, so
  # the source must have the arms' optimizer, Root + Q-AdamW)
  s=${2:-0}; at=${3:-800}; arms=${4:-quartet2,lora}; extra=${5:-}; sa=${FORK_SRC:-bf16}
  src=.fork_src$s/30m/$sa; dst=.fork$s$([ "$at" = 800 ] || echo "_$at")
  step data 60 python bench/study.py --data-only
  if [ ! -f "$src/checkpoint/state.pt" ]; then
    step "fork${s}_src" 200 python bench/study.py --size 30m --arms "$sa" --out ".fork_src$s" --tokens 100e6 \
        --skip-data --time-budget 185 -- --seed "$s" --stop-after "$at"
  fi
  if [ ! -d "$dst/30m/$sa" ] && [ -f "$src/checkpoint/state.pt" ]; then mkdir -p "$dst/30m" && cp -r "$src" "$dst/30m/$sa"; fi
  # shellcheck disable=SC2086  # EXTRA is a list of flags
  # the arms get what is left of a 10-minute call (SECONDS counts from the script's start); ERR=1 keeps ~15 s per arm
  # for bench/attn_qk_error.py on each finished arm afterwards (Q-Attn's errors on its own Q, K, V; session 36)
  # FORK_END: the second of the call by which the arms must be done (a caller that spent time first passes less)
  err=${ERR:-0}; t=$((${FORK_END:-585} - SECONDS)); [ "$t" -gt 470 ] && t=470
  [ "$err" = 1 ] && t=$((t - 15 * ($(echo "bf16,$arms" | tr -cd , | wc -c) + 1)))
  step "fork${s}_arms" "$t" python bench/study.py --size 30m --arms "$sa,$arms" --out "$dst" --tokens 100e6 \
      --skip-data --time-budget $((t - 20)) --export "$OUT/fork${s}_$at" -- --seed "$s" --init-from "$src" \
      --lora-realign-every 300 --lora-realign-after 600 $extra
  if [ "$err" = 1 ]; then
    for a in ${arms//,/ } bf16; do
      r="$dst/30m/$a"
      grep -q '"status": "done"' "$r/summary.json" 2>/dev/null && step "err_fork${s}_$a" 40 python bench/attn_qk_error.py \
          "$r" --json "$OUT/err_fork${s}_$a.json"
    done
    cat "$OUT"/err_fork*.log 2>/dev/null | grep -E "^\S|vs none|  all"
  fi ;;
first_block_lora)
  # planned for session 9 (one nvidia-h200, ~7 min): the full stack with block 0 in BF16 and a rank-RANK
  # (default 128) LoRA-SVD branch realigned every 300 steps from step 600 (post hoc, rank 128 removed 57 % of the
  # ROOT model's forward damage, rank 32 20 %: docs/RESULTS.md, session 8); compare with +3.65 % (block 0 only)
  r=${2:-128}; b=${3:-390}
  step data 60 python bench/study.py --data-only
  step "fb_full_lora$r" $((b + 15)) python bench/study.py --size 30m --arms full --out ".study_fb_lora$r" \
      --tokens 100e6 --skip-data --time-budget "$b" --export "$OUT/fb_full_lora$r" -- \
      --policy configs/policy_full_stack_first_block_bf16.toml --lora-rank "$r" --lora-realign-every 300 \
      --lora-realign-after 600 ;;
full_frozen)
  # issue 7 (one nvidia-h200, ~6 min; carry the data): the full stack with block 0 in BF16 and a rank-RANK (default
  # 64) LoRA-SVD branch with frozen factors (arm fullf: ROOT then steps W exactly as it would the dense weight; the
  # branch is re-split every EVERY steps from step EVERY, default 100). Compare with session 13's trained factors:
  # +3.22 % train / +2.64 % val at rank 64 (first_block_lora 64). Session 14: rank 256 every 100, +2.52 % / +1.93 %.
  # The run directory names both RANK and EVERY, so a warm machine resumes only the same variant.
  r=${2:-64}; b=${3:-380}; e=${4:-100}; v="$r$([ "$e" = 100 ] || echo "_e$e")"
  step data 60 python bench/study.py --data-only
  step "fb_fullf_lora$v" $((b + 15)) python bench/study.py --size 30m --arms fullf --out ".study_fb_frozen$v" \
      --tokens 100e6 --skip-data --time-budget "$b" --export "$OUT/fb_fullf_lora$v" -- \
      --policy configs/policy_full_stack_first_block_bf16.toml --lora-rank "$r" --lora-realign-every "$e" \
      --lora-realign-after "$e" ;;
pdl)
  # issue 2, one nvidia-h200 (~2 min): the PDL launch of the RTN/SR quantize kernel (CONFIG["pdl"], default 1):
  # bit-exact eagerly and from a CUDA graph, then the pdl sweeps (PDL and ordinary launches alternating) at both shapes
  step pdl_tests 240 python -m pytest -m gpu -q -p no:cacheprovider tests/test_quantize_kernels.py -k pdl
  step pdl_sweep_4096 60 python bench/quantize.py --sweep --sweeps pdl,pdl_sr,pdl_rtn46,pdl_had16 \
      --sweep-shape 4096x4096 --out "$OUT/s4096"
  step pdl_sweep_16384 90 python bench/quantize.py --sweep --sweeps pdl,pdl_sr \
      --sweep-shape 16384x8192 --out "$OUT/s16384" ;;
verify)
  # one nvidia-h200 (~9 min): the whole GPU suite, the quantize table and the 124M training step after a change of a
  # kernel default (session 12 made CONFIG["pdl"] = 1 with only its own 12 GPU tests run)
  nvidia-smi -L; python -c "import torch, triton; print(torch.__version__, triton.__version__)"
  step gpu_tests 240 python -m pytest -m gpu -q -n 8 -p no:cacheprovider tests/ --deselect tests/test_attention.py
  step attention_tests 120 python -m pytest -m gpu -x -q -p no:cacheprovider tests/test_attention.py
  step quantize 60 python bench/quantize.py --bench --quick --out "$OUT"
  step train_step 150 python bench/train_step.py --steps 10 --warmup 3 --modes reduce-overhead \
      --json "$OUT/train_step.jsonl" ;;
fsdp_sweep)
  # issue 8's FSDP2 scaling, one call on an nvidia-h200-x2 (~5 min): bash bench/run_h200.sh fsdp_sweep [MB]
  # (sequences per GPU, default 16): the 1-GPU baseline, then FSDP2 as is, without resharding after forward,
  # with BF16 parameter all-gathers, and both (each profiled on rank 0); with MB given, also DDP
  mb=${2:-16}
  CUDA_VISIBLE_DEVICES=0 step dist_1gpu 100 python bench/distributed.py --model 124m --parallel none --profile \
      --micro-batch "$mb" --json "$OUT/dist_none.json"
  variants=("base:" "noreshard:--no-reshard" "bf16:--bf16-params" "both:--no-reshard --bf16-params")
  [ -n "${2:-}" ] && variants=("base:" "both:--no-reshard --bf16-params")
  for v in "${variants[@]}"; do
    step "fsdp2_${v%%:*}" 110 torchrun --nproc-per-node 2 bench/distributed.py --model 124m --parallel fsdp2 \
        ${v#*:} --profile --micro-batch "$mb" --json "$OUT/fsdp2_${v%%:*}.json"
  done
  if [ -n "${2:-}" ]; then
    step ddp 110 torchrun --nproc-per-node 2 bench/distributed.py --model 124m --parallel ddp --profile \
        --micro-batch "$mb" --json "$OUT/ddp.json"
  fi ;;
fsdp_optim)
  # issue 8's optimizer side, one call on an nvidia-h200-x2 (~4 min): distributed Newton–Schulz (1 GPU, then
  # all_to_all vs gather on 2), then QAdamW on 1 GPU vs FSDP2 (micro-batch 64, no reshard, BF16 gathers)
  CUDA_VISIBLE_DEVICES=0 step ns_1gpu 60 python bench/distributed.py --model 124m --ns --json "$OUT/ns_1gpu.json"
  step ns_2gpu 80 torchrun --nproc-per-node 2 bench/distributed.py --model 124m --ns --json "$OUT/ns_2gpu.json"
  CUDA_VISIBLE_DEVICES=0 step qadamw_1gpu 100 python bench/distributed.py --model 124m --parallel none \
      --optim qadamw --micro-batch 64 --json "$OUT/qadamw_none.json"
  step qadamw_fsdp2 110 torchrun --nproc-per-node 2 bench/distributed.py --model 124m --parallel fsdp2 \
      --optim qadamw --micro-batch 64 --no-reshard --bf16-params --json "$OUT/qadamw_fsdp2.json" ;;
attn_ab)
  # issue 4 + 5 on one nvidia-h200 (~8 min): the attention GPU tests and bench (checks, tile sweep, table) of
  # this tree, the same table from an older tree when one is carried under .ab/old (its fp4compile/ and bench/,
  # e.g. git archive REV fp4compile bench | tar -x -C .ab/old), then the fused Q-AdamW test and timing
  step attn_tests 150 python -m pytest -m gpu -x -q -p no:cacheprovider tests/test_attention.py
  step attn_bench 170 python bench/attention.py --phase all --all-checks --sweep-budget 60 --json "$OUT/attn.json"
  if [ -d .ab/old/fp4compile ]; then
    ( cd .ab/old && export PYTHONPATH=$PWD && step attn_bench_old 90 python bench/attention.py --phase table \
        --json "$OUT/attn_old.json" )
  fi
  step optim_tests 60 python -m pytest -m gpu -q -p no:cacheprovider tests/test_optim_fused.py
  step optim 110 python bench/optim.py --skip check,peak,root --out "$OUT/optim.json" ;;
layout_ab)
  # issue 3 + 4 on one nvidia-h200 (~6 min): Q-Attn outputs and gradients stored [B, T, H, D] (like SDPA's)
  # against the tree carried under .ab/old (contiguous [B, H, T, D]): the attention GPU tests, the backward's
  # layout microbenchmark, then the GPT-124M full-stack step of both (the new one profiled)
  step attn_tests 170 python -m pytest -m gpu -x -q -p no:cacheprovider tests/test_attention.py
  step attn_layout 120 python bench/attention_layout.py
  step step_full_stack 170 python bench/train_step.py --policy full_stack --modes reduce-overhead --steps 20 \
      --warmup 3 --profile --json "$OUT/train_step.jsonl"
  if [ -d .ab/old/fp4compile ]; then
    ( cd .ab/old && export PYTHONPATH=$PWD && step step_full_stack_old 150 python bench/train_step.py \
        --policy full_stack --modes reduce-overhead --steps 20 --warmup 3 --json "$OUT/train_step_old.jsonl" )
  fi ;;
requant_ab)
  # issue 3 on one nvidia-h200 (~7 min): the backward's requantized operands dequantized straight into transposed
  # tensors (session 27) against the tree carried under .ab/old (dequantize, then a transposing quantize): the
  # quantize GPU tests, bench/requant.py (bytes equal, pair times, the transposed dequantization's tiles), then
  # the GPT-124M full-stack step of both (the new one profiled)
  step quant_tests 150 python -m pytest -m gpu -x -q -p no:cacheprovider tests/test_quantize_kernels.py \
      tests/test_backend.py
  step requant 90 python bench/requant.py --sweep
  step_ab 170 150 ;;
deq_ab)
  # issues 3 + 4 on one nvidia-h200 (~7 min): the dequantize kernel's bit-placed decode (session 27) against the
  # tree under .ab/deq0 (select-chain decode): its GPU tests, bench/requant.py of both, the full-stack step of both;
  # then the Q-Attn kernels' device time at the step's shape for the trees under .ab/<rev> (a bisect of the dK/dV
  # kernel's 3.24 -> 3.72 ms between sessions 22 and 26), this tree first and last
  step deq_tests 120 python -m pytest -m gpu -q -x -p no:cacheprovider tests/test_quantize_kernels.py -k dequantize
  step requant 50 python bench/requant.py --sweep
  ( cd .ab/deq0 && export PYTHONPATH=$PWD && step requant_deq0 50 python bench/requant.py --sweep )
  step step_full_stack 120 python bench/train_step.py --policy full_stack --modes reduce-overhead --steps 20 \
      --warmup 3 --json "$OUT/train_step.jsonl"
  ( cd .ab/deq0 && export PYTHONPATH=$PWD && step step_full_stack_deq0 100 python bench/train_step.py \
      --policy full_stack --modes reduce-overhead --steps 20 --warmup 3 --skip-bf16 --json "$OUT/train_step_deq0.jsonl" )
  for t in ${BISECT:-head s22 prep cachekeys head2}; do
    if [ "${t:0:4}" = head ]; then P=$PWD; else P=$PWD/.ab/$t; fi
    PYTHONPATH=$P step "attn_at_$t" 70 python bench/attention_kernels_at.py --label "$t"
  done ;;
dkdv_ab)
  # issue 4 on one nvidia-h200 (~5 min): the candidate docs/bench_logs/session27_dkdv_offsets.diff (the dK/dV kernel
  # computing its [B, T, Hkv, D] output offsets itself instead of taking three stride arguments, its pre-f79a592
  # argument list; 269 vs 310 us per call before and after f79a592) applied to a copy under .ab/cand, against this
  # tree, alternating, each with a digest of dQ, dK, dV (same bits expected); then the attention GPU tests of the
  # candidate and the full-stack step of both
  rm -rf .ab/cand && mkdir -p .ab/cand && cp -r fp4compile bench .ab/cand/ && \
    git apply --directory=.ab/cand docs/bench_logs/session27_dkdv_offsets.diff || echo "candidate did not apply"
  for t in main cand main2 cand2; do
    if [ "${t:0:4}" = cand ]; then P=$PWD/.ab/cand; else P=$PWD; fi
    PYTHONPATH=$P step "attn_at_$t" 60 python bench/attention_kernels_at.py --label "$t"
  done
  PYTHONPATH=$PWD/.ab/cand step attn_tests_cand 170 python -m pytest -m gpu -x -q -p no:cacheprovider tests/test_attention.py
  step step_full_stack 120 python bench/train_step.py --policy full_stack --modes reduce-overhead --steps 20 \
      --warmup 3 --json "$OUT/train_step.jsonl"
  ( cd .ab/cand && export PYTHONPATH=$PWD && step step_full_stack_cand 100 python bench/train_step.py \
      --policy full_stack --modes reduce-overhead --steps 20 --warmup 3 --skip-bf16 --json "$OUT/train_step_cand.jsonl" )
  if [ -d .ab/dec0/fp4compile ]; then
    # the one E2M1 decoder (2105ce6) against the tree before it carried under .ab/dec0: quantize and Q-AdamW benches
    step quant_bench 80 python bench/quantize.py --bench --no-eager
    ( cd .ab/dec0 && export PYTHONPATH=$PWD && step quant_bench_dec0 80 python bench/quantize.py --bench --no-eager --out "$OUT/dec0" )
    step optim 80 python bench/optim.py --skip check,profile,warps,peak,root --out "$OUT/optim.json"
    ( cd .ab/dec0 && export PYTHONPATH=$PWD && step optim_dec0 80 python bench/optim.py \
        --skip check,profile,warps,peak,root --out "$OUT/optim_dec0.json" )
  fi ;;
fused_ab)
  # issue 3 on one nvidia-h200 (~6 min): the candidate docs/bench_logs/session28_fused_requant.diff (the
  # backward's MS-EDEN requantization as one fp4compile::requantize whose pass 1 decodes the forward copy's tiles)
  # applied to a copy of the tree it was written on (8b772cd, carried as .ab/base: git archive 8b772cd fp4compile
  # bench tests), against this tree (transposed dequantization + quantize): the candidate's kernel GPU tests and
  # bench/requant.py (bytes, times, fused tiles), the GPT-124M full-stack step of both
  rm -rf .ab/cand && cp -r .ab/base .ab/cand && \
    git apply --directory=.ab/cand docs/bench_logs/session28_fused_requant.diff || echo "candidate did not apply"
  ( cd .ab/cand && export PYTHONPATH=$PWD && step quant_tests_cand 170 python -m pytest -m gpu -x -q \
      -p no:cacheprovider tests/test_quantize_kernels.py -k "dequantize_and_ops or ms_eden or bit_exact_large" && \
    step requant_cand 120 python bench/requant.py --sweep && \
    step step_full_stack_cand 150 python bench/train_step.py --policy full_stack --modes reduce-overhead \
      --steps 20 --warmup 3 --profile --skip-bf16 --json "$OUT/train_step_cand.jsonl" )
  step step_full_stack 100 python bench/train_step.py --policy full_stack --modes reduce-overhead --steps 20 \
      --warmup 3 --json "$OUT/train_step.jsonl" ;;
both_ab)
  # issues 3 + 4 on one nvidia-h200 (~6 min): a gradient's two MS-EDEN copies from one row-wise pass
  # (fp4compile::quantize_both, session 28) against the tree carried under .ab/old (two quantize calls, the
  # transposed one through a transposing copy): the quantize GPU tests, bench/quantize_both.py (bytes, times),
  # the GPT-124M full-stack step of both (the new one profiled); then the attn_bisect trees (.ab/ORDER)
  step quant_tests 170 python -m pytest -m gpu -x -q -p no:cacheprovider tests/test_quantize_kernels.py \
      -k "dequantize_and_ops or ms_eden or bit_exact_large"
  step backend_tests 150 python -m pytest -m gpu -x -q -p no:cacheprovider tests/test_backend.py
  step quantize_both 60 python bench/quantize_both.py
  step_ab 150 100
  for t in head $(cat .ab/ORDER 2>/dev/null); do
    if [ "$t" = head ]; then P=$PWD; else P=$PWD/.ab/$t; fi
    PYTHONPATH=$P step "attn_at_$t" 40 python bench/attention_kernels_at.py --label "$t"
  done ;;
dkdv_contig_ab)
  # issue 4 on one nvidia-h200 (~5 min): the candidate docs/bench_logs/session28_dkdv_contig.diff (dK, dV stored
  # contiguous by f79a592^'s store, whose sm_90 SASS is that of the 271-us kernel instruction for instruction; O and
  # dQ keep SDPA's layout) applied to a copy under .ab/cand, against this tree: the Q-Attn kernels' device time of
  # both alternating (same dQ/dK/dV digest expected), the attention GPU tests of the candidate, the full-stack step
  # of both (the candidate's profiled: the Q/K/V gradient concatenation now reads dK, dV transposed)
  rm -rf .ab/cand && mkdir -p .ab/cand && cp -r fp4compile bench tests .ab/cand/ && \
    git apply --directory=.ab/cand docs/bench_logs/session28_dkdv_contig.diff || echo "candidate did not apply"
  for t in main cand main2 cand2; do
    if [ "${t:0:4}" = cand ]; then P=$PWD/.ab/cand; else P=$PWD; fi
    PYTHONPATH=$P step "attn_at_$t" 60 python bench/attention_kernels_at.py --label "$t"
  done
  ( cd .ab/cand && export PYTHONPATH=$PWD && step attn_tests_cand 170 python -m pytest -m gpu -x -q \
      -p no:cacheprovider tests/test_attention.py && \
    step step_full_stack_cand 150 python bench/train_step.py --policy full_stack --modes reduce-overhead \
      --steps 20 --warmup 3 --profile --json "$OUT/train_step_cand.jsonl" )
  step step_full_stack 100 python bench/train_step.py --policy full_stack --modes reduce-overhead --steps 20 \
      --warmup 3 --skip-bf16 --json "$OUT/train_step.jsonl" ;;
attn_regcap)
  # issue 4 on one nvidia-h200 (~3 min; session 29): is the dK/dV kernel's 271 -> 310 us (since f79a592) occupancy?
  # Offline sm_90 compiles give 05bb13a's kernel 167 registers (3 CTAs of 4 warps per SM) and HEAD's 184 (2 per
  # SM). The launched kernels' registers and SASS digests of this tree and of .ab/05bb13a (git archive 05bb13a
  # fp4compile), then this tree's kernels with the dK/dV kernel capped at 160 / 168 registers (static: no spill at
  # 160, +72 instructions) and the dQ kernel at 128, alternating with the default
  PYTHONPATH=$PWD step attn_head 90 python bench/attention_kernels_at.py --label head --sass
  if [ -d .ab/05bb13a/fp4compile ]; then
    PYTHONPATH=$PWD/.ab/05bb13a step attn_05bb13a 90 python bench/attention_kernels_at.py --label 05bb13a --sass
  fi
  C160='{"dkdv": {"maxnreg": 160}}'
  attn_configs attn 16,12,1024,64 "cap160=$C160" 'cap168={"dkdv": {"maxnreg": 168}}' 'dq128={"dq": {"maxnreg": 128}}' \
      head2 "cap160b=$C160" ;;
regcap_ab)
  # issues 2, 3 on one nvidia-h200 (~5 min; session 29): register caps. The quantize sweeps with MS-EDEN pass 1
  # capped at 96/80 registers (static sm_90: 108 -> 96 at the same instructions, no spill) and the SR / 4/6 kernel
  # at 96, then the full-stack step of this tree and of a copy under .ab/cand whose CONFIG has e_maxnreg 96,
  # alternating (30 steps each, no profiler). Since session 30 made 96 the default, the copy is this tree (s30_ab
  # uses bench/train_step.py --quantize-config instead)
  step cap_tests 120 python -m pytest -m gpu -x -q -p no:cacheprovider tests/test_quantize_kernels.py \
      -k "register_capped or pass1_variants"
  step sweeps 200 python bench/quantize.py --sweep --sweeps had128e,rtn46,sr --no-eager --out "$OUT/sweeps"
  rm -rf .ab/cand && mkdir -p .ab/cand && cp -r fp4compile bench .ab/cand/ && \
    sed -i 's/"e_maxnreg": 0/"e_maxnreg": 96/' .ab/cand/fp4compile/kernels/quantize.py && \
    grep -c '"e_maxnreg": 96' .ab/cand/fp4compile/kernels/quantize.py
  step_cand_ab ;;
attn_div_ab)
  # issue 4 on one nvidia-h200 (~5 min; prepared in session 30): dS's per-block divisions by short sequences
  # (docs/bench_logs/session30_attn_short_divisions.diff: RN(x / 6) as one FMUL + two FMAs, RN(1 / sf) as
  # rcp.approx + two FMAs, both proven on CPU against exact oracles; static sm_90: dK/dV 3960 -> 3520 instructions,
  # dQ 3088 -> 2688). The candidate under .ab/cand (this tree + the diff): its attention GPU tests (bit-exact
  # against the reference) and proof tests, then the kernel times of this tree and the candidate alternating, then
  # the full-stack step of both (30 steps each, alternating)
  rm -rf .ab/cand && mkdir -p .ab/cand && cp -r fp4compile bench tests .ab/cand/ && \
    { git apply --directory=.ab/cand docs/bench_logs/session30_attn_short_divisions.diff || ( cd .ab/cand && \
      patch -p1 < ../../docs/bench_logs/session30_attn_short_divisions.diff ); } > "$OUT/patch.log" 2>&1
  grep -c _div6_rn .ab/cand/fp4compile/kernels/attention.py
  ( cd .ab/cand && export PYTHONPATH=$PWD && step cand_attn_tests 150 python -m pytest -x -q -p no:cacheprovider \
      tests/test_attention.py -k "gpu or cuda or div6 or reciprocal or fma_emulation or short_divisions" )
  for t in head cand head2 cand2; do
    case $t in cand*) P=$PWD/.ab/cand;; *) P=$PWD;; esac
    PYTHONPATH=$P step "attn_$t" 60 python bench/attention_kernels_at.py --label "$t"
  done
  step_cand_ab ;;
s31_final)
  # issues 4, 3 on one nvidia-h200 (~4 min; session 31): this tree with dS's short divisions and RTN 4/6 on
  # magnitudes capped at 128: the attention tests that run on CUDA, the attention table against SDPA, the full-stack
  # step profiled against BF16
  step attn_tests 150 python -m pytest -x -q -p no:cacheprovider tests/test_attention.py \
      -k "gpu or cuda or div6 or reciprocal or fma_emulation or short_divisions"
  step attn_table 90 python bench/attention.py --phase table --json "$OUT/attn_table.json"
  step step_full_stack 150 python bench/train_step.py --policy full_stack --modes reduce-overhead --steps 30 \
      --warmup 3 --profile --json "$OUT/train_step.jsonl" ;;
attn_caps31)
  # issue 4 on one nvidia-h200 (~2 min; session 31): with dS's short divisions the dK/dV kernel at 2 stages spills
  # less under a cap (static sm_90: 128 registers 18 spilled words instead of 32, 144: 30/25; 4 programs per SM at
  # 128 by registers and shared memory, 3 at 144 and 168); each against the default when it ran (3 stages, 168; 2 stages
  # since 5990e33), alternating
  C128='{"dkdv": {"num_stages": 2, "maxnreg": 128}}'; C144='{"dkdv": {"num_stages": 2, "maxnreg": 144}}'
  C168='{"dkdv": {"num_stages": 2, "maxnreg": 168}}'
  attn_configs attn 16,12,1024,64 head "dkdv2c128=$C128" "dkdv2c144=$C144" "dkdv2c168=$C168" \
      head2 "dkdv2c128b=$C128" "dkdv2c144b=$C144" "dkdv2c168b=$C168" ;;
s31_check)
  # issue 4 on one nvidia-h200 (~1.5 min; session 31): the dK/dV kernel's new default (2 stages, 168 registers): the
  # attention tests that run on CUDA, the kernel times with the launched SASS
  step attn_tests 150 python -m pytest -x -q -p no:cacheprovider tests/test_attention.py -k "gpu or cuda"
  PYTHONPATH=$PWD step attn_kernels 60 python bench/attention_kernels_at.py --label head --sass ;;
s32_c)
  # issue 3 on one nvidia-h200 (~7 min; session 32): every GEMM that dequantizes both operands reads them as the
  # copies' bf16 q * S from the quantize launches (quantize_dq / quantize_both_dq: RTN's quantize kernel stores it,
  # MS-EDEN's pass 2 dequantizes the tile whose scales it makes; gemm_dequantized). The GPU tests of the new ops,
  # bench/dq_operands.py (the 12 GEMMs of a 124M layer, old / new / cuBLAS BF16), the step profiled against BF16,
  # then alternating FP4COMPILE_DQ_OPERANDS none / all twice and fwd once (the pass's cache key holds the switch)
  step dq_tests 240 python -m pytest -x -q -p no:cacheprovider tests/test_quantize_kernels.py tests/test_gemm.py \
      -k "quantize_dq or dequantized or dequantize_and_ops"
  step dq_operands 150 python bench/dq_operands.py
  step step_full_stack 150 python bench/train_step.py --policy full_stack --modes reduce-overhead --steps 30 \
      --warmup 3 --profile --json "$OUT/train_step.jsonl"
  for t in none all none2 all2 fwd; do
    FP4COMPILE_DQ_OPERANDS=${t%2} step "step_$t" 100 python bench/train_step.py --policy full_stack \
        --modes reduce-overhead --steps 30 --warmup 3 --skip-bf16 --json "$OUT/train_step_$t.jsonl"
  done ;;
s32_d)
  # issues 3, 4 on one nvidia-h200 (~5 min; session 32): s32_c's GPU tests again (its quantize_both_dq check passed
  # an int through .cpu(): the test, fixed), then the attention tests on CUDA, the table against SDPA with dK/dV at
  # 2 stages (session 31's default), and the D = 128 paper-split backward at 1 stage capped at 168 registers
  step dq_tests 240 python -m pytest -x -q -p no:cacheprovider tests/test_quantize_kernels.py tests/test_gemm.py \
      -k "quantize_dq or dequantized or dequantize_and_ops"
  step attn_tests 150 python -m pytest -x -q -p no:cacheprovider tests/test_attention.py -k "gpu or cuda"
  step attn_table 90 python bench/attention.py --phase table --json "$OUT/attn_table.json"
  Q='{"dq": {"num_stages": 1, "maxnreg": 168}}'; K='{"dkdv": {"num_stages": 1, "maxnreg": 168}}'
  attn_configs attn128 8,16,2048,128 head "dq1c168=$Q" "dkdv1c168=$K" head2 "dq1c168b=$Q" "dkdv1c168b=$K" ;;
s33_b)
  # issues 2, 3 on one nvidia-h200 (~7 min; session 33): save_weight_copies on by default (s33_next: 49.06, 48.67 vs
  # 49.35, 49.06 ms); MS-EDEN's pass 2 PDL-launched behind its pass 1 (CONFIG epdl, new, off by default): its GPU
  # tests, the step alternating twice with --quantize-config '{"epdl": 1}', then the default step profiled against
  # BF16 in one call. (epdl measured no gain and was reverted: docs/bench_logs/session33_eden_pass2_pdl.diff; this
  # mode needs that diff applied)
  step pdl_tests 240 python -m pytest -x -q -p no:cacheprovider tests/test_quantize_kernels.py \
      -k "gpu_pdl or quantize_dq"
  for t in main epdl main2 epdl2; do
    case $t in epdl*) c='{"epdl": 1}';; *) c='{}';; esac
    step "step_$t" 100 python bench/train_step.py --policy full_stack --modes reduce-overhead --steps 30 --warmup 3 \
        --skip-bf16 --quantize-config "$c" --json "$OUT/train_step_$t.jsonl"
  done
  step_ab 200 0 ;;
s33_d)
  # issue 3 on one nvidia-h200 (~5 min; session 33): a linear's bias in the TMA GEMM's epilogue (linear.FUSE_BIAS,
  # new, on: the qkv projection's bias add before Q-Attn was a separate pass, 12 calls of triton_poi_fused_2, 0.44 ms
  # per step in s33_c's profile): the GPU tests of the bias, then the step alternating twice with FP4COMPILE_FUSE_BIAS=0
  step bias_tests 200 python -m pytest -x -q -p no:cacheprovider tests/test_gemm.py tests/test_backend.py -m gpu \
      -k "bias or gemm_dequantized or cuda_graph_replays"
  for t in main nofuse main2 nofuse2; do
    case $t in nofuse*) v=0;; *) v=1;; esac
    FP4COMPILE_FUSE_BIAS=$v step "step_$t" 100 python bench/train_step.py --policy full_stack --modes reduce-overhead \
        --steps 30 --warmup 3 --skip-bf16 --json "$OUT/train_step_$t.jsonl"
  done ;;
s35_next)
  # issue 3 on one nvidia-h200 (~7 min; prepared in session 34): passes/amax.py (FUSE_AMAX, off): an activation's
  # amax reduced inside the Inductor kernel that makes it (LayerNorm, GELU), the quantize kernel reading x once. Its
  # GPU tests, then the step interleaved (default, fused, A/A), both arms profiled (the amax kernel's calls should
  # go 108 -> 72, the LayerNorm / GELU kernels become reductions). Adopt FUSE_AMAX if it wins beyond the A/A spread
  step amax_tests 250 python -m pytest -x -q -p no:cacheprovider tests/test_quantize_kernels.py \
      tests/test_backend.py -m gpu -k "given_amax or gpu_fused_amax"
  # two more arms re-check the GEMM routing now that the cuBLAS path's scale and cast are one pass (SCALE_CAST): every
  # NVFP4 GEMM through cuBLAS + scale_cast, and the "auto" lowering (cuBLAS with the scale fused by Inductor)
  step step_ab 400 python bench/step_ab.py --rounds 12 --block 10 --json "$OUT/step_ab.jsonl" --arm base \
      --arm famax:fp4compile.passes.amax.FUSE_AMAX=true --arm cublas:fp4compile.kernels.gemm.DEFAULT_IMPL=dequant_cublas \
      --arm lowauto:options.gemm_lowering=auto --arm base2 --profile base --profile famax --profile-top 45 ;;
s35_b)
  # issue 3 on one nvidia-h200 (~7 min; session 35): s35_next's FUSE_AMAX=all lost +0.29 ms (the GELU kernel became a
  # reduction, 63 -> 116 us per call). Its "norms" mode (LayerNorm outputs only: their kernel reduces rows anyway) and
  # "all" with the GELU's reduction over rows of 1024 or 256 (POINTWISE_ROW); the GPU tests of every mode first
  step amax_tests 300 python -m pytest -x -q -p no:cacheprovider tests/test_quantize_kernels.py \
      tests/test_backend.py -m gpu -k "given_amax or gpu_fused_amax"
  step step_ab 420 python bench/step_ab.py --rounds 12 --block 10 --json "$OUT/step_ab.jsonl" --arm base \
      --arm norms:fp4compile.passes.amax.FUSE_AMAX='"norms"' \
      --arm all1024:fp4compile.passes.amax.FUSE_AMAX='"all"',fp4compile.passes.amax.POINTWISE_ROW=1024 \
      --arm all256:fp4compile.passes.amax.FUSE_AMAX='"all"',fp4compile.passes.amax.POINTWISE_ROW=256 \
      --arm base2 --profile norms --profile all1024 --profile-top 30 ;;
s36_qk)
  # issues 4 and 7 on one nvidia-h200 (session 36; carry .data/corpus, .data/gpt2.tiktoken): the 30M qattn arm at 100M
  # tokens against the same with K smoothed before Q-Attn quantizes it (qattn_sk: FP4COMPILE_QK_TRANSFORM=smooth_k),
  # seed SEED (default 0), both at once on the one GPU (time-sliced: tokens/s not a measurement), each in BUDGET s
  # (default 500); the same command again on the warm machine continues them. Then each finished arm's Q-Attn errors
  # on its own Q, K, V (bench/attn_qk_error.py, every transform, and the error split); ERR_ONLY=1 skips the training;
  # ARMS="qattn" trains that arm alone (its tokens/s then a measurement); SERIAL=1 trains the arms one after another
  seed=${SEED:-0} budget=${2:-500}; dir=.study30m_qk_seed$seed arms=${ARMS:-qattn qattn_sk}
  step data 60 python bench/study.py --data-only
  if [ "${ERR_ONLY:-0}" != 1 ]; then
    for a in $arms; do
      step "study_${a}_seed$seed" $((budget + 15)) python bench/study.py --size 30m --arms "$a" --out "$dir" \
          --tokens 100e6 --skip-data --time-budget "$budget" --export "$OUT/study_${a}_seed$seed" -- --seed "$seed" &
      [ "${SERIAL:-0}" = 1 ] && wait
    done
    wait
  fi
  for a in $arms; do
    r="$dir/30m/$a"
    [ -f "$r/checkpoint/state.pt" ] && step "err_${a}_seed$seed" 120 python bench/attn_qk_error.py "$r" \
        --batches 2 --batch-size 4 --json "$OUT/err_${a}_seed$seed.json"
  done
  cat "$OUT"/err_*.log 2>/dev/null ;;
s39_a)
  # issue 3 on one nvidia-h200 (~6 min; prepared in session 38 without device time): fp4compile::smooth_rotate, the
  # Q, K transform as one Triton pass per tensor (kernels/rotate.py), on the GPU: its tests and the transform's,
  # the transform alone against a copy (bench/qk_transform.py), then the 124M step with it
  # (QK_TRANSFORM_IMPL="op") against the aten transform (the default; session 38: +1.6 ms over none), Q, K
  # untransformed and BF16 Inductor, interleaved in one process
  step gpu_tests 240 python -m pytest -m gpu -q -n 4 -p no:cacheprovider tests/test_rotate.py tests/test_attention.py \
      -k "rotate or transform or gpu_kernel"
  step qk_transform 120 python bench/qk_transform.py --json "$OUT/qk_transform.json"
  step step_ab 300 python bench/step_ab.py --rounds 10 --block 10 --json "$OUT/step_ab.jsonl" --arm fp4 \
      --arm op:fp4compile.passes.attention.QK_TRANSFORM_IMPL='"op"' \
      --arm none:fp4compile.passes.attention.QK_TRANSFORM='"none"' --arm bf16:backend=inductor ;;
s39_b)
  # issues 3 and 7 on one nvidia-h200 (~9.5 min; carry .data/corpus, .data/gpt2.tiktoken): the Q, K transform alone
  # with each kind's GPU kernel time (bench/qk_transform.py --profile: s39_a timed the op at 0.27x of a copy at the
  # 124M shape while it made the 124M step 0.44 ms faster), then the 30M full stack at 300M tokens with the
  # transform, seed 0 (SIZE=30m SEED=0; continue with "study124 300e6 fullbest:SECONDS" on the warm machine)
  step qk_profile 100 python bench/qk_transform.py --profile --json "$OUT/qk_transform.json"
  study124_run 300e6 fullbest:"${BUDGET:-450}" ;;
s40_mean)
  # issue 3 on one nvidia-h200 (~8 min; prepared in session 40, not yet run), two opt-in changes: K's mean over T in
  # the Q, K transform by kernels/rotate.py's partial-sums kernel instead of torch.mean (~0.7 TB/s, 35 us of the
  # op's 136 us per 124M layer in session 39), and the backward's 192 seed draws as one (passes/seeds.py; 0.47 ms
  # of session 33's profile): their GPU tests, the transform alone (--profile), then the 124M step with each and
  # both against the default and BF16 Inductor, interleaved in one process
  step gpu_tests 200 python -m pytest -m gpu -q -n 4 -p no:cacheprovider tests/test_rotate.py tests/test_seeds.py \
      tests/test_backend.py -k "rotate or kernel or seeds or fresh or unbiased"
  step qk_transform 120 python bench/qk_transform.py --profile --json "$OUT/qk_transform.json"
  step step_ab 240 python bench/step_ab.py --rounds 6 --block 10 --json "$OUT/step_ab.jsonl" --arm fp4 \
      --arm tmean:fp4compile.kernels.rotate.MEAN_IMPL='"triton"' --arm seeds:fp4compile.passes.seeds.POOL_SEEDS=true \
      --arm both:fp4compile.kernels.rotate.MEAN_IMPL='"triton"',fp4compile.passes.seeds.POOL_SEEDS=true \
      --arm bf16:backend=inductor
  cat "$OUT/qk_transform.log" ;;
s41_root)
  # issue 5 on one nvidia-h200 (~9 min; prepared in session 41, not yet run), three opt-in changes to Q-Root's step:
  # the p99 clip's threshold by torch.topk (a selection of the ~1 % largest |U|) instead of a sort of every element
  # (root.QUANTILE_IMPL; bit-equal values, CPU 9x faster); the symmetric Gram products X·Xᵀ, A·A, E² at 3/4 of the
  # flops (root.SYMMETRIC_MIN_ROWS; 512 here, so that the 124M stacks, m = 768, take it too); the NVFP4 NS's operands
  # as quantize_dq's bf16 q·S instead of quantize + dequantize_blocks (root.NS_DQ; bit-equal); and, against the new
  # default (Root's element-wise step by torch._foreach ops), the per-matrix loop (loop): the Q-Root GPU tests, the
  # 124M Q-Root step profiled by kernel family (the NS GEMM time share), then the Q-Root step at 124M and 1B per
  # arm, the default arm first and last (drift)
  step gpu_tests 100 python -m pytest -m gpu -q -p no:cacheprovider tests/test_optim_root.py
  step root_profile 60 python bench/optim.py --skip check,adamw,profile,warps,peak,root --root-profile 124M
  step optim_root 380 python bench/optim.py --skip check,adamw,profile,warps,peak --root-sets 124M,1B \
      --root-arm base --root-arm 'topk:fp4compile.optim.root.QUANTILE_IMPL="topk"' \
      --root-arm 'sym:fp4compile.optim.root.SYMMETRIC_MIN_ROWS=512' --root-arm 'dq:fp4compile.optim.root.NS_DQ=true' \
      --root-arm 'all:fp4compile.optim.root.QUANTILE_IMPL="topk",fp4compile.optim.root.SYMMETRIC_MIN_ROWS=512,fp4compile.optim.root.NS_DQ=true' \
      --root-arm 'loop:fp4compile.optim.root.ROOT_FOREACH=false' --root-arm base2 --out "$OUT/optim_root.json"
  cat "$OUT/root_profile.log" "$OUT/optim_root.log" ;;
s46_qadamw)
  # issue 5 on one nvidia-h200 (~3 min; session 46, run there; carry .ab, with .ab/old a checkout of
  # 6c2bb0f: \`git worktree add .ab/old 6c2bb0f\`). Q-AdamW's kernel 2 reading the Hadamard signs as float tables
  # (fused._sign_table: no per-element byte load and int -> float conversion), without the selects outside the tensor,
  # the forward RHT's signs in its first butterfly stage: static sm_90 SASS 253.5 -> 241.5 instructions per element,
  # the same bits. The fused kernels' GPU test (bit for bit against the torch reference on CUDA), then the Q-AdamW
  # step against torch.optim.AdamW(fused=True) on the 124M and 1B sets, this tree and .ab/old alternating twice
  step gpu_tests 200 python -m pytest -m gpu -q -rf -p no:cacheprovider tests/test_optim_fused.py
  for t in new old new2 old2; do
    case $t in old*) P=$PWD/.ab/old;; *) P=$PWD;; esac
    ( cd "$P" && export PYTHONPATH=$P && step "qadamw_$t" 90 python bench/optim.py \
        --skip check,profile,warps,peak,root --out "$OUT/qadamw_$t.json" )
  done
  # what v's 4/6 costs (static: 241.5 -> 213.0 per element; on real tiny-GPT states with SR its transform's error is
  # ~16 % higher without it, still 62 % under direct NVFP4's, docs/OPTIM.md)
  step qadamw_variants 90 python bench/qadamw_variants.py --sets 124M,1B --only 13,0,13 --out "$OUT/qadamw_variants.json"
  tail -n 3 "$OUT/gpu_tests.log"; grep -h "QAdamW step" "$OUT"/qadamw_*.log; cat "$OUT/qadamw_variants.log" ;;
s47_root)
  # issue 5 on one nvidia-h200 (~3 min; session 47): the Q-Root step with session 47's defaults (ns_sym_b, ns_shared_x
  # and FUSE_AMAX on, whose GPU tests passed in s47_fork's first calls) against the NS options of sessions <= 46,
  # alternating, 124M and 1B sets (SETS), BF16 NS in the same runs
  O='options.ns_sym_b=false,options.ns_shared_x=false,fp4compile.optim.root.FUSE_AMAX=false'
  step optim_root "${T:-300}" python bench/optim.py --skip check,adamw,profile,warps,peak --root-sets "${SETS:-124M,1B}" \
      --root-arm base --root-arm "old:$O" --root-arm base2 --root-arm "old2:$O" --out "$OUT/optim_root.json"
  grep -h "section=QRoot" "$OUT/optim_root.log" ;;
s47_fork)
  # issue 5 (and 7) on one nvidia-h200 (session 47; ~10 min, then the same command again on the warm machine to
  # finish the arms). Session 47's first two calls ran the GPU tests of ns_glue and Q-Root (10 passed) but no fork: a
  # QRoot arm cannot fork from an AdamW (bf16) or Root + AdamW (bf16root) source. Now the 30M fork of seed 0 at step
  # 800 from bf16qroot (BF16, Root with BF16 NS + Q-AdamW): fullbest (session 47's defaults: QRoot's ns_sym_b +
  # ns_shared_x + FUSE_AMAX) against fullbest_nsold (the NS options of sessions <= 46) and fullbest_v6 (Q-AdamW's v
  # without 4/6), paired. The fork's own output (and its packed files) go to $OUT/fork. Carry .data/corpus without
  # train-09 and train-10 (moved aside): with the tracked tree's ~14 MB the whole corpus exceeds the 64 MiB that travel
  mkdir -p "$OUT/fork"; OUT=$OUT/fork FORK_SRC=bf16qroot bash "$0" fork 0 800 \
      fullbest,fullbest_nsold,fullbest_v6 >"$OUT/fork_call.log" 2>&1
  ls .fork0/30m ;;
s49_qk)
  # issues 4 and 7 on one nvidia-h200 (session 49; ~10 min, then the same command again on the warm machine to finish
  # the arms): Q-Attn's Q and K in 1x16 blocks along head_dim (passes/attention.py QK_BLOCKS "1x16"; session 49's forks,
  # seeds 0, 1: val -0.0031 / -0.0041). The GPU tests of the Q-Attn kernels (the 1x16 copies bit for bit with the
  # reference, the CUDA op's own copies, a 1x16 case under FlashAttention's rule), then the 30M fork of seed S (default 0) at step
  # 800 from bf16qroot: the tiles against 1x16, paired, each finished arm's Q-Attn errors on its own Q, K, V (ERR=1:
  # bench/attn_qk_error.py, with the 1x16 line). Carry the whole corpus. Output of the fork: $OUT/fork. Session 49 ran
  # it (seeds 0, 1) as fullbest,fullbest_qk1x16 with the dS products on the 1x16 copy itself (not runnable on FP4
  # tensor cores); "1x16" now re-quantizes it in tiles for them, so the next run measures that form: arms
  # fullbest_qk16x16 (the tiles, = fullbest) and fullbest_qk1x16.
  # (the GPU test once per machine: .gpu_s49 is git-ignored, so it stays on the warm machine)
  if [ ! -f .gpu_s49/ok ]; then   # every GPU test of the file (the transform's compile tests since session 49's fix)
    step gpu_tests 200 python -m pytest -m gpu -q -p no:cacheprovider tests/test_attention.py
    tail -n 3 "$OUT/gpu_tests.log"
    grep -q " passed" "$OUT/gpu_tests.log" && ! grep -q " failed\| error" "$OUT/gpu_tests.log" && mkdir -p .gpu_s49 \
        && touch .gpu_s49/ok
  fi
  mkdir -p "$OUT/fork"; OUT=$OUT/fork FORK_SRC=bf16qroot ERR=1 FORK_END=$((585 - SECONDS)) bash "$0" fork "${S:-0}" 800 \
      fullbest_qk16x16,fullbest_qk1x16 >"$OUT/fork_call.log" 2>&1
  grep -h "done at step\|stopping before\|1x16 blocks\|vs none" "$OUT/fork_call.log" "$OUT"/fork/*.log 2>/dev/null ;;
s50_qk)
  # issues 4 + 3 on one nvidia-h200 (~4 min; session 50): QK_1X16's backward re-quantization moved into the prep launch
  # (attention._requant_body: the saved 1x16 copies re-quantized in tiles from their codes and scales; session 50's
  # step A/B of the earlier separate quantize launch: 1.0227x the tiles' step, +1.19 ms). Every GPU test of the Q-Attn
  # file (the CUDA op's backward with QK_1X16 against the reference), then the 124M step with "1x16" against the
  # tiles, interleaved (8 rounds of 10 steps, as session 49 and 50 ran it)
  step gpu_tests 200 python -m pytest -m gpu -q -p no:cacheprovider tests/test_attention.py
  tail -n 3 "$OUT/gpu_tests.log"
  step step_ab 300 python bench/step_ab.py --rounds 8 --block 10 --json "$OUT/step_ab.jsonl" --arm fp4 \
      --arm 'qk1x16:fp4compile.passes.attention.QK_BLOCKS="1x16"'
  tail -n 4 "$OUT/step_ab.log" ;;
s51_qk)
  # issues 4 + 3 + 7 on one nvidia-h200 (~10 min; session 51; carry .data/corpus, .data/gpt2.tiktoken; SEED=S): the
  # 124M step with QK_BLOCKS="1x16" (its re-quantization inside the backward's prep launch since session 50, from the
  # same read as the copy's code x scale since session 52) and with 1x16 without the Q, K transform, against the
  # tiles, alone on the GPU (8 rounds of 10 steps); the prep launch alone (bench/attention_prep.py); then every GPU
  # test of the Q-Attn file and the non-finite input tests (session 52) beside the start of seed S's 30M 300M-token
  # fullbest_qk1x16 run (B seconds; the study124 command with the same SIZE, SEED and arm resumes it on the warm
  # machine)
  qk1x16_ab 300 8 none
  step prep 60 python bench/attention_prep.py; cat "$OUT/prep.log"
  qattn_finite_tests 300 tests/test_attention.py tests/test_finite.py tests/test_quantize_kernels.py &
  SIZE=30m study124_run 300e6 "fullbest_qk1x16:${B:-330}"
  wait ;;
s54_next)
  # issues 3, 4 + 7 on one nvidia-h200 (~10 min; session 54; carry .data/corpus, .data/gpt2.tiktoken): the 124M step
  # of the four Q, K preparations (tiles / 1x16, each with and without the transform; session 54 measured 1x16 at
  # +0.83 ms with the transform and 1x16 without it at -0.30 ms: which part is the blocks, which the transform?),
  # 6 rounds of 10 steps alone on the GPU; each Q-Attn kernel's device time at the 124M layer's shape, tiles against
  # 1x16 (whose dS operands take 65 KB of shared memory per program instead of 49: 3 dQ programs per SM, not 4), 1x16
  # with one pipeline stage in dQ (24 KB), and 1x16 with 128-query dQ programs of 8 warps (each K, K2, V load serves
  # twice the rows; 2 programs per SM); the GPU tests of check_finite (session 54: Q-Attn's copies checked too); then
  # seed S's (default 2) 30M 300M-token fullbest_qk1x16 run for B seconds (default 150); `SIZE=30m SEED=S bash
  # bench/run_h200.sh study124 300e6 fullbest_qk1x16:560` on the warm machine finishes it
  s54_measure
  SEED=${SEED:-2} SIZE=30m study124_run 300e6 "fullbest_qk1x16:${B:-150}" ;;
s54_measure)
  # s54_next's measurements alone (~9 min; session 55, when too little device time was left for a training run)
  s54_measure ;;
ncu)
  # issues 2, 4 on one GPU (~4 min; session 55): Nsight Compute's first use in this project (KINDS.md: it reads the
  # counters on the Firecracker machines): issue slots, occupancy and warp stall reasons of Q-Attn's kernels at the
  # 124M layer's shape with Q, K in tiles and in 1x16 blocks (why is 1x16's dQ 20 % slower for 5 % more
  # instructions?), and of MS-EDEN's and RTN's quantize at 16384x8192 (why 0.45 of copy bandwidth against 0.88?)
  nvidia-smi -L; uname -r
  ncu_probe "${NCU_T:-150}" ;;
s55_b)
  # for a session whose device comes late (session 55): the last B seconds (default 200) of seed S's (default 2) 30M
  # 300M-token fullbest_qk1x16 run, resuming the one that `SIZE=30m SEED=S bash bench/run_h200.sh study124 300e6
  # fullbest_qk1x16:560` started on the warm machine, then the ncu mode's probe
  SEED=${SEED:-2} SIZE=30m study124_run 300e6 "fullbest_qk1x16:${B:-200}"
  ncu_probe "${NCU_T:-150}" ;;
s57_gemm)
  # issue 3 on one GPU (~5 min; prepared in session 56): does the TMA GEMM's autotuner pick its fastest tile? Session
  # 56's ncu saw the 124M step's 16384x3072x768 GEMM (fc1.fprop, fc2.dgrad: 24 per step) in a 4-warp 128x128 tile at
  # 60 % tensor-pipe use, 141.8 us against cuBLAS's 116.6 (75 %), where the flattened 128x256 tile took 122 us
  # (bench/gemm.py --lower on an H100; that tile was chosen by an autotune run under ncu and kept on disk). First the
  # 124M full-stack step compiles and runs a few steps, so that the disk cache holds the choices a training run
  # makes (its precompile workers tune GEMMs while others compile on the same GPU); then every tile timed
  # explicitly against that stored choice, a fresh pick (disk cache off) and cuBLAS; then the gemm124 workload once
  # without ncu (it tunes outside ncu if nothing is stored yet), and the ncu probe, which loads the stored choice
  nvidia-smi -L
  step train_step 240 python bench/train_step.py --policy full_stack --modes reduce-overhead --steps 5 --warmup 1 \
      --skip-bf16
  step tma_configs 240 python bench/gemm.py --tma-configs; cat "$OUT/tma_configs.log"
  step gemm124_tune 120 python bench/ncu_kernels.py gemm124
  ncu_probe "${NCU_T:-120}" gemm124 ;;
s58_fused)
  # issues 3 + 4 on one GPU (~4 min; prepared in session 57, which had no device time left for it): the Q, K
  # transform inside fp4compile::qattn's quantize launches (QK_TRANSFORM_IMPL "fused", opt-in): its GPU test against
  # "op" (the smooth_rotate kernel, then the launches), then the 124M full-stack step with "op" (the default) and
  # "fused" against BF16, interleaved in one process; session 55's count puts the saving near 0.4 ms
  nvidia-smi -L
  step gpu_tests 120 python -m pytest -m gpu -q -rf -p no:cacheprovider tests/test_rotate.py -k "fused or gpu_kernel"
  tail -3 "$OUT/gpu_tests.log"
  step step_ab 300 python bench/step_ab.py --rounds 6 --block 10 --json "$OUT/step_ab.jsonl" --arm op \
      --arm fused:fp4compile.passes.attention.QK_TRANSFORM_IMPL=fused --arm bf16:backend=inductor
  grep -v Warning "$OUT/step_ab.log" | tail -6 ;;
s60_det)
  # issue 7 on one GPU (~6 min; session 60): are two runs of one arm, seed, code and machine the same bits? The 30M
  # default arm (fullbest) twice from step 0 to step N (default 100), seed 0, each in its own folder, then the train
  # loss of every step compared (bench/compare_runs.py: the first step that differs and the largest difference); a
  # difference from step 1 on means the 300M-token reruns' spread (0.1-0.2 point of val gap across sessions) holds
  # run-to-run nondeterminism, not only code and machine changes. Then the GPU tests of the kernels changed since
  # session 55's whole-suite run (attention, GEMM, rotation, non-finite), until END seconds (default 560).
  # DET=1: both runs with `--deterministic` (fp4compile.determinism; session 60 built it after this call found the
  # default runs parting at step 2), and the GPU tests of deterministic mode first
  nvidia-smi -L
  [ "${DET:-0}" = 1 ] && step det_tests 120 python -m pytest -m gpu -q -rfs -p no:cacheprovider tests/test_gemm.py \
      -k deterministic && tail -2 "$OUT/det_tests.log"
  step data 60 python bench/study.py --data-only
  for r in a b; do
    rm -rf ".study_det_$r"
    step "det_$r" 150 python bench/study.py --size 30m --arms fullbest --out ".study_det_$r" --tokens 300e6 \
        --skip-data --time-budget 130 -- --seed 0 --stop-after "${N:-100}" $([ "${DET:-0}" = 1 ] && echo --deterministic)
  done
  step compare 30 python bench/compare_runs.py .study_det_a/30m/fullbest .study_det_b/30m/fullbest; cat "$OUT/compare.log"
  step gpu_tests $((${END:-560} - SECONDS)) python -m pytest -m gpu -q -rfs -n 8 -p no:cacheprovider \
      tests/test_attention.py tests/test_gemm.py tests/test_rotate.py tests/test_finite.py
  tail -4 "$OUT/gpu_tests.log" ;;
gpu_suite)
  # every GPU test on one GPU (~6-9 min; session 62: a cold machine took over 420 s, a warm one with 10 workers 510 s
  # for 293 of 300): 8 workers, -v so that an interrupted run still names every test that ended in its log;
  # SECONDS_LIMIT (default 560) bounds the pytest run. Arguments after the mode replace "tests/" (files, node ids,
  # -k EXPR), e.g. to run only what an interrupted run did not reach (session 63: 5 of 309 in 440 s; session 64, an
  # H200: all 309 in 465 s, the three slowest Q-Root tests 241-315 s each (~13 s alone) with 8 workers x 16 OpenMP
  # threads; tests/conftest.py now gives each worker 2 threads on 16 CPUs: not yet run on the GPU).
  # FP4COMPILE_TEST_TIMES (tests/conftest.py) writes each test's phases as they end, so a run the limit kills still
  # gives the slowest 15 tests (pytest's --durations would print only at the session's end) and, against a
  # collection, the tests it did not reach
  nvidia-smi -L; shift
  FP4COMPILE_TEST_TIMES="$OUT/gpu_times.tsv" step gpu_suite "${SECONDS_LIMIT:-560}" python -m pytest -m gpu -v -rfs \
      -n 8 -p no:cacheprovider "${@:-tests/}"
  grep -c " PASSED " "$OUT/gpu_suite.log"; grep -E " (FAILED|ERROR) " "$OUT/gpu_suite.log" | head -20
  tail -n 30 "$OUT/gpu_suite.log"
  touch "$OUT/gpu_times.tsv"
  echo "== slowest 15 (seconds, setup + call + teardown)"
  awk -F'\t' '{t[$1] += $4} END {for (n in t) printf "%8.1f  %s\n", t[n], n}' "$OUT/gpu_times.tsv" | sort -rn | head -15
  python -m pytest -m gpu --collect-only -q -p no:cacheprovider "${@:-tests/}" 2>/dev/null | grep "::" \
      >"$OUT/gpu_collected.txt"
  echo "== not reached: $(awk -F'\t' 'FILENAME == ARGV[1] {if ($2 == "teardown") ended[$1] = 1; next} !($0 in ended)' \
      "$OUT/gpu_times.tsv" "$OUT/gpu_collected.txt" | tee "$OUT/gpu_not_reached.txt" | wc -l)"
  cat "$OUT/gpu_not_reached.txt" ;;
s61_fill)
  # issue 7 on one GPU (~4 min; session 61, after s60_det DET=1 found two --deterministic runs the same bits over 300
  # steps at 0.86x the default's tokens/s): what does torch's fill of uninitialized memory cost deterministic mode
  # (FP4COMPILE_DETERMINISTIC_FILL=0 turns it off; under CUDA graphs the fills replay every step)? The 30M default arm
  # (fullbest, seed 0) to step N (default 100) with the fill, without it, and in the default mode, one after the
  # other; then the first two compared step by step (the same bits: nothing reads memory it did not write) and the
  # three runs' tokens/s
  nvidia-smi -L
  step data 60 python bench/study.py --data-only
  for r in fill nofill default; do
    rm -rf ".study_det_$r"
    ( [ "$r" = nofill ] && export FP4COMPILE_DETERMINISTIC_FILL=0
      step "det_$r" 150 python bench/study.py --size 30m --arms fullbest --out ".study_det_$r" --tokens 300e6 \
          --skip-data --time-budget 130 -- --seed 0 --stop-after "${N:-100}" $([ "$r" != default ] && echo --deterministic) )
  done
  step compare 30 python bench/compare_runs.py .study_det_fill/30m/fullbest .study_det_nofill/30m/fullbest
  cat "$OUT/compare.log"; grep -h "tok_per_s" "$OUT"/det_*.log ;;
s58_b)
  # issues 3 + 4 on one GPU (~5 min; session 58, after s58_fused found the fold 0.28 ms slower than "op", its quantize
  # launch twice as long), as run at tree 230201f: the fused GPU test, bench/qk_fold.py (there also the rotation's
  # operand built or loaded, once per 1..8 slabs), then the 124M step with "op", "fused" with the operand loaded and
  # built once per 4 slabs, and BF16 (its step A/B failed: the loaded operand, cached at first call, was allocated in
  # the CUDA-graph pool). The variants' knobs and that A/B were removed after: the GPU test and bench/qk_fold.py
  # (plain, op, fused) are left
  nvidia-smi -L
  step gpu_tests 120 python -m pytest -m gpu -q -rf -p no:cacheprovider tests/test_rotate.py -k "fused or gpu_kernel"
  tail -2 "$OUT/gpu_tests.log"
  step qk_fold 120 python bench/qk_fold.py --json "$OUT/qk_fold.jsonl"; cat "$OUT/qk_fold.log" ;;
s53_qk)
  # issue 4 (+ the non-finite GPU tests) on one nvidia-h200 (~6 min; session 53, when too little device time was
  # left for s51_qk's training run): s51_qk's 1x16 step A/B and prep launch alone on the GPU, then its GPU tests,
  # until END seconds (default 570)
  qk1x16_ab 240 8 none
  step prep 60 python bench/attention_prep.py; cat "$OUT/prep.log"
  qattn_finite_tests $((${END:-570} - SECONDS)) tests/test_attention.py tests/test_finite.py tests/test_quantize_kernels.py ;;
s53_b)
  # s53_qk reordered for a short call (session 53): the GPU tests first (the non-finite ones first), for at most T1
  # seconds (default 150), then the 1x16 step A/B in 6 rounds
  qattn_finite_tests "${T1:-150}" tests/test_finite.py tests/test_quantize_kernels.py tests/test_attention.py
  qk1x16_ab 240 6 ;;
s51_fork)
  # issue 7 on one nvidia-h200 (session 51; ~10 min, then the same command again on the warm machine to finish the
  # arms; carry the whole corpus): does 1x16 need the Q, K transform? The 30M fork of seed S (default 0) at step 800
  # from bf16qroot, as s49_qk: fullbest_qk1x16 against fullbest_qk1x16_none (QK_TRANSFORM "none"), paired, with each
  # finished arm's Q-Attn errors on its own Q, K, V (ERR=1). Output of the fork: $OUT/fork
  mkdir -p "$OUT/fork"; OUT=$OUT/fork FORK_SRC=bf16qroot ERR=1 FORK_END=$((585 - SECONDS)) bash "$0" fork "${S:-0}" 800 \
      fullbest_qk1x16,fullbest_qk1x16_none >"$OUT/fork_call.log" 2>&1
  grep -h "done at step\|stopping before\|1x16 blocks\|vs none" "$OUT/fork_call.log" "$OUT"/fork/*.log 2>/dev/null ;;
s46_eden)
  # issues 2 + 3 on one nvidia-h200 (~4.5 min; session 46, run there; s45_eden's companion): MS-EDEN's
  # pass 1 with a quarter of a 128-chunk per thread (CONFIG e_impl 3, kernels/quantize._eden_pass1_quarter_kernel:
  # RHT-128's stages up to h = 16 in registers, h = 32 and 64 by two exchanges; static sm_90 35.8 instructions and 2.1
  # SHFL per element at the default 16x512 tile's 128-register cap, 35.6 at 158 uncapped, 40.0 and 2.2 at 80 with one
  # quarter per thread, against e_impl 0's 40.8 and 3.3 at 96). The pass-1 GPU test (every variant, bit for bit with
  # the reference), the quarter-chunk tile/cap sweep, the MS-EDEN rows at 16384x8192 against copy bandwidth (every
  # e_impl), then the 124M step with it (two and one quarter per thread) against the default and BF16 Inductor,
  # interleaved in one process.
  Q=fp4compile.kernels.quantize.CONFIG
  eden_pass1_ab had128u "quarter:$Q[e_impl]=3" "quarter1:$Q[e_impl]=3,$Q[u_rows]=8,$Q[u_maxnreg]=0" ;;
s45_eden)
  # issues 2 + 3 on one nvidia-h200 (~7 min; prepared in session 45, not run: s46_eden measured e_impl 2 at 0.30 of
  # copy bandwidth, so its sweep is moot): MS-EDEN's pass 1 with half a
  # 128-chunk per thread (CONFIG e_impl 2, kernels/quantize._eden_pass1_half_kernel: RHT-128's one cross-thread stage,
  # static sm_90 35.0 instructions and 1.1 SHFL per element at 185 registers, or 37.8 capped at 128 with spills,
  # against e_impl 0's 40.8 and 3.3 at 96). Its GPU test (bit for bit with the reference, tiles and caps), the pass-1
  # tile/cap sweep and the MS-EDEN rows at 16384x8192 against copy bandwidth, then the 124M step with it (uncapped and
  # capped) against the default and BF16 Inductor, interleaved in one process.
  Q=fp4compile.kernels.quantize.CONFIG
  eden_pass1_ab had128h "half:$Q[e_impl]=2" "half128:$Q[e_impl]=2,$Q[h_maxnreg]=128" ;;
s45_shared)
  # issue 5 on one nvidia-h200 (~5 min; prepared in session 45, not yet run): (1) QRoot's ns_shared_x (X quantized
  # once per NS step in 16x16 blocks for both X Xᵀ and B·X: 3 quantizations and dequantizations per step instead of
  # 4, no transposing pass, with the shift no rescaled copy of X; CPU error about the default's, docs/OPTIM.md), alone
  # and with ns_sym_b (free in session 43); (2) root.FUSE_AMAX (the quantized operands' amax taken by the ns_glue
  # passes that make them, no amax passes; the same bits). GPU tests (ns_glue and Q-Root, incl. the shared X's
  # CUDA-vs-CPU and graphed-vs-eager test and FUSE_AMAX bit for bit), then the Q-Root step per arm on the 124M and 1B
  # sets in one process, the default first and last (drift), then the op profile.
  step gpu_tests 240 python -m pytest -m gpu -q -n 4 -rf -p no:cacheprovider tests/test_ns_glue.py \
      tests/test_optim_root.py
  A='fp4compile.optim.root.FUSE_AMAX=true' S='options.ns_sym_b=true,options.ns_shared_x=true'
  step optim_root 240 python bench/optim.py --skip check,adamw,profile,warps,peak --root-sets 124M,1B \
      --root-arm base --root-arm 'shared:options.ns_shared_x=true' --root-arm "symshared:$S" \
      --root-arm "amax:$A" --root-arm "symshared_amax:$S,$A" --root-arm 'symb:options.ns_sym_b=true' \
      --root-arm base2 --root-arm "symshared2:$S" --root-arm "symshared_amax2:$S,$A" --out "$OUT/optim_root.json"
  step root_ops 60 python bench/optim.py --skip check,adamw,profile,warps,peak,root --root-ops 124M \
      --root-ops-arm "symshared_amax:$S,$A"
  tail -n 5 "$OUT/gpu_tests.log"; grep -h "section=QRoot" "$OUT/optim_root.log" ;;
s44_next)
  # issue 5 on one nvidia-h200 (~4 min; session 44, after s44_shift). (1) ns_glue's kernels without index division
  # (the shift kernel took ~4x its bytes' time); (2) the guard's matvecs from A's bf16 values (ns_glue.matvec).
  # GPU tests; the Q-Root step of this tree (new), .ab/mid (1 only) and .ab/old (s44_shift's tree), alternating;
  # the step by torch op.
  root_trees new old mid new2 old2 mid2 ;;
s44_shift)
  # issue 5 on one nvidia-h200 (~5 min; session 44). The identity-shifted NS polynomial's glue in two Triton passes
  # (kernels/ns_glue.sub_diag, shift_poly) instead of six torch passes. GPU tests of ns_glue (bit for bit against the
  # torch forms) and Q-Root; the Q-Root step of this tree against .ab/old (82c016d with FP4COMPILE_NS_GLUE=1: the
  # scale-and-round kernels of s44_glue, the torch shift) and .ab/mid (the shift's two passes, without the update's
  # y_scale), alternating; the step by torch op.
  root_trees new old mid new2 old2 ;;
s44_glue)
  # issue 5 on one nvidia-h200 (~4 min; prepared in session 43, not yet run): the NVFP4 NS's per-matrix scale-and-round
  # passes by kernels/ns_glue.py (ns_glue.KERNEL, opt-in: one contiguous Triton pass each instead of torch's strided
  # broadcast kernels, ~7 ms of the 124M set's Q-Root step in session 43's op profile). Its GPU tests (bit for bit
  # against torch, the NS with and without it) and the Q-Root GPU tests, then the Q-Root step per arm (the default
  # first and last), and the step by torch op with it. If it wins: make KERNEL the default (docs, tests).
  step gpu_tests 200 python -m pytest -m gpu -q -n 4 -rf -p no:cacheprovider tests/test_ns_glue.py \
      tests/test_optim_root.py
  step optim_root 150 python bench/optim.py --skip check,adamw,profile,warps,peak --root-sets 124M,1B \
      --root-arm base --root-arm 'glue:fp4compile.kernels.ns_glue.KERNEL=true' --root-arm base2 \
      --out "$OUT/optim_root.json"
  ( export FP4COMPILE_NS_GLUE=1 && step root_ops 60 python bench/optim.py --skip check,adamw,profile,warps,peak,root \
      --root-ops 124M )
  tail -n 5 "$OUT/gpu_tests.log"; cat "$OUT/optim_root.log" ;;
s43_sr)
  # issues 2 and 5 on one nvidia-h200 (~8 min; session 43). (1) E2M1 stochastic rounding by directed-rounding PTX
  # (kernels/quantize.SR_RP: min over E2M1's three pieces of ceil(piece - u), one fma.rp + add.rp each) in the SR
  # quantize kernel and in Q-AdamW's kernel; (2) the NVFP4 Newton-Schulz's glue in fewer passes (root._scaled: scale
  # and round in one pass; the update in two; Xᵀ quantized by the op's transposed quantize, no transposed copy).
  # The GPU tests of all three (bit for bit against the torch reference; the NS against the CPU and eager), the
  # Q-Root step of this tree against the tree before (.ab/old, 6a6cd3a), the SR quantize kernel against the tree
  # before (.ab/quantize_old.py, outputs checked identical, then timed alternately), Q-AdamW's default against the
  # comparison form and a 128-register cap (the directed form takes 165 registers), Q-Root's step by torch op
  step gpu_tests 220 python -m pytest -m gpu -q -n 4 -p no:cacheprovider tests/test_quantize_kernels.py \
      tests/test_optim_fused.py tests/test_optim_root.py
  step root_new 90 python bench/optim.py --skip check,adamw,profile,warps,peak --root-sets 124M,1B \
      --out "$OUT/root_new.json"
  ( cd .ab/old && export PYTHONPATH=$PWD && step root_old 90 python bench/optim.py \
      --skip check,adamw,profile,warps,peak --root-sets 124M,1B --out "$OUT/root_old.json" )
  step root_new2 90 python bench/optim.py --skip check,adamw,profile,warps,peak --root-sets 124M,1B \
      --out "$OUT/root_new2.json"
  step quantize_ab 100 python bench/quantize_ab.py --old .ab/quantize_old.py --cases "SR,SR 4/6,RTN" --rounds 5 \
      --json "$OUT/quantize_ab.json"
  step qadamw_variants 120 python bench/qadamw_variants.py --sets 124M,1B --only 11,12,0,11 \
      --out "$OUT/qadamw_variants.json"
  step root_ops 60 python bench/optim.py --skip check,adamw,profile,warps,peak,root --root-ops 124M
  tail -n 3 "$OUT/gpu_tests.log"; grep -h "QRoot step" "$OUT"/root_*.log; cat "$OUT/quantize_ab.log" \
      "$OUT/qadamw_variants.log" ;;
s42_ns)
  # issue 5 on one nvidia-h200 (~5 min; prepared in session 42, not yet run): the NVFP4 NS accuracy options (QRoot's
  # ns_sym_b: B of B·X in 16x16 blocks; ns_residual: X's quantizations in two NVFP4 terms, one product each more per
  # step, or x2d: one two-term 16x16-block X serving both products): their GPU tests (CUDA against the CPU
  # reference, CUDA graphs against eager), then the Q-Root step at 124M per arm, the default arm first and last
  # (drift)
  step gpu_tests 120 python -m pytest -m gpu -q -p no:cacheprovider tests/test_optim_root.py -k "sym_b or residual"
  step optim_root 240 python bench/optim.py --skip check,adamw,profile,warps,peak --root-sets 124M \
      --root-arm base --root-arm 'symb:options.ns_sym_b=true' \
      --root-arm 'xt:options.ns_sym_b=true,options.ns_residual=xt' \
      --root-arm 'both:options.ns_sym_b=true,options.ns_residual=x+xt' \
      --root-arm 'x2d:options.ns_sym_b=true,options.ns_residual=x2d' --root-arm base2 --out "$OUT/optim_root.json"
  cat "$OUT/gpu_tests.log" "$OUT/optim_root.log" ;;
s40_suite)
  # one nvidia-h200 (~7 min; session 40): the whole GPU suite but attention's kernel tests (unchanged since session
  # 32; its transform tests ran in s39_c) on torch 2.11, the first since session 34 (fp4compile::smooth_rotate the
  # default since session 39), with the slowest tests listed
  nvidia-smi -L; python -c "import torch, triton; print(torch.__version__, triton.__version__)"
  step gpu_tests 420 python -m pytest -m gpu -q -n 12 -rfE --durations=12 -p no:cacheprovider tests/ \
      --deselect tests/test_attention.py
  tail -n 40 "$OUT/gpu_tests.log" ;;
s39_c)
  # issue 3 on one nvidia-h200 (~7 min): with QK_TRANSFORM_IMPL="op" the default, the GPU tests of attention, the
  # backend, the precompile workers and the rotate kernel on torch 2.11, then the 124M step with the default against
  # the aten transform and BF16 Inductor, interleaved in one process
  step gpu_tests 270 python -m pytest -m gpu -q -n 6 -p no:cacheprovider tests/test_attention.py tests/test_backend.py \
      tests/test_precompile.py tests/test_rotate.py
  step step_ab 200 python bench/step_ab.py --rounds 6 --block 10 --json "$OUT/step_ab.jsonl" --arm fp4 \
      --arm torch:fp4compile.passes.attention.QK_TRANSFORM_IMPL='"torch"' --arm bf16:backend=inductor ;;
s38_a)
  # issue 3 on one nvidia-h200 (~5 min; session 38): the Q, K transform as one BF16 matmul by the +-1 Hadamard in
  # Q, K's own storage order (s37_next: the FP32 product cost 4.5 ms of the 124M step); its GPU compile test, then
  # the step with it against Q, K untransformed and BF16 Inductor, interleaved in one process
  step gpu_tests 200 python -m pytest -m gpu -q -n 4 -p no:cacheprovider tests/test_attention.py -k "transform"
  step step_ab 230 python bench/step_ab.py --rounds 10 --block 10 --json "$OUT/step_ab.jsonl" --arm fp4 \
      --arm none:fp4compile.passes.attention.QK_TRANSFORM='"none"' --arm bf16:backend=inductor ;;
s37_next)
  # issues 3, 4 and all on one nvidia-h200 (~9 min; prepared in session 37): the GPU tests of attention, the backend
  # and the precompile workers on torch 2.11 (the default Q, K transform smooth_k+hadamard, its Triton compile, the
  # on_error fallback with the backward compiled inside compile_fx), then the 124M step with the default transform
  # against Q, K untransformed and against BF16 Inductor, interleaved in one process
  step gpu_tests 300 python -m pytest -m gpu -q -n 6 -p no:cacheprovider tests/test_attention.py tests/test_backend.py \
      tests/test_precompile.py
  step step_ab 230 python bench/step_ab.py --rounds 10 --block 10 --json "$OUT/step_ab.jsonl" --arm fp4 \
      --arm none:fp4compile.passes.attention.QK_TRANSFORM='"none"' --arm bf16:backend=inductor ;;
s35_final)
  # issues 3 and all on one nvidia-h200 (~9 min; session 35): FUSE_AMAX="all" with POINTWISE_ROW=1024 the default now
  # (s35_b: -0.20 ms, as "norms"); the step against the pass off, "norms" and BF16 Inductor interleaved, then the GPU
  # suite on the final tree (attention's test apart, as in sessions 33-34: its kernels did not change)
  step step_ab 230 python bench/step_ab.py --rounds 10 --block 10 --json "$OUT/step_ab.jsonl" --arm fp4 \
      --arm off:fp4compile.passes.amax.FUSE_AMAX='"off"' --arm norms:fp4compile.passes.amax.FUSE_AMAX='"norms"' \
      --arm bf16:backend=inductor --arm fp4b
  step gpu_suite 330 python -m pytest -m gpu -q -n 6 -p no:cacheprovider tests/ --deselect tests/test_attention.py ;;
s34_final)
  # issues 3 and all on one nvidia-h200 (~6 min; session 34): the default step against BF16 Inductor, interleaved in
  # one process (bench/step_ab.py), then the GPU suite on the final tree (SCALE_CAST on by default now; attention's
  # test apart, as in session 33: its kernels did not change)
  step step_ab 150 python bench/step_ab.py --rounds 12 --block 10 --json "$OUT/step_ab.jsonl" --arm fp4 \
      --arm bf16:backend=inductor --arm fp4b
  step gpu_suite 330 python -m pytest -m gpu -q -n 6 -p no:cacheprovider tests/ --deselect tests/test_attention.py ;;
ab)
  # any interleaved in-process A/B of the 124M full-stack step (bench/step_ab.py; session 34):
  # bash bench/run_h200.sh ab [--rounds R] [--block N] --arm base --arm NAME:module.ATTR=JSON ...
  shift; step step_ab 560 python bench/step_ab.py --json "$OUT/step_ab.jsonl" "$@" ;;
s34_next)
  # issue 3 on one nvidia-h200 (~8 min; prepared in session 33): kernels.gemm.SCALE_CAST (the cuBLAS wgrad GEMMs'
  # scale, bias and cast in one Triton pass instead of three eager kernels; off): its GPU tests and the bias
  # tests, the step alternating twice with FP4COMPILE_SCALE_CAST=1, then the default step profiled against BF16 in
  # one call (session 33's bias epilogue was timed only against itself). Adopt SCALE_CAST if it wins
  step sc_tests 200 python -m pytest -x -q -p no:cacheprovider tests/test_gemm.py -m gpu -k "scale_cast or bias"
  for t in main sc main2 sc2; do
    case $t in sc*) v=1;; *) v=0;; esac
    FP4COMPILE_SCALE_CAST=$v step "step_$t" 100 python bench/train_step.py --policy full_stack --modes reduce-overhead \
        --steps 30 --warmup 3 --skip-bf16 --json "$OUT/train_step_$t.jsonl"
  done
  step_ab 200 0 ;;
s33_e)
  # issue 3 (~1 min; session 33): s33_d's bias GPU tests again after the TMA epilogue lost its FMA contraction
  # (enable_fp_fusion=False with a bias: the scale and the add as two FP32 ops, like every other implementation)
  step bias_tests 150 python -m pytest -x -q -p no:cacheprovider tests/test_gemm.py tests/test_backend.py -m gpu \
      -k "bias or gemm_dequantized or cuda_graph_replays" ;;
s33_c)
  # issue 3 on one nvidia-h200 (~7 min; session 33): the default step (saved weight copies) profiled with BF16's in
  # one call, every kernel listed (where the other 17.7 ms go), then the GPU suite on the final tree (attention's
  # test apart: it ran in session 32, and the kernels did not change)
  step profile 200 python bench/train_step.py --policy full_stack --modes reduce-overhead --steps 20 --warmup 3 \
      --profile --profile-bf16 --profile-top 90 --json "$OUT/train_step.jsonl"
  step gpu_suite 330 python -m pytest -m gpu -q -n 6 -p no:cacheprovider tests/ --deselect tests/test_attention.py ;;
s33_next)
  # issue 3 on one nvidia-h200 (~6 min; prepared in session 32): plain RTN / SR now store their dq values at once
  # (f4a1069; RTN + dq 167 -> 128 registers static sm_90, not yet run on the GPU): the quantize_dq GPU tests, the
  # 12-GEMM table; then the step: the default (forward dq operands), FP4COMPILE_SAVE_WEIGHT_COPIES=1 (the backward
  # requantizes W from the saved forward codes: no amax + quantize of each weight in the backward), alternating
  # twice, and FP4COMPILE_DQ_OPERANDS=none once. Adopt SAVE_WEIGHT_COPIES if it wins (peak memory in the log)
  step dq_tests 240 python -m pytest -x -q -p no:cacheprovider tests/test_quantize_kernels.py tests/test_gemm.py \
      -k "quantize_dq or dequantized"
  step dq_operands 150 python bench/dq_operands.py
  for t in base savew base2 savew2 none; do
    case $t in savew*) w=1; d=fwd;; none) w=0; d=none;; *) w=0; d=fwd;; esac
    FP4COMPILE_SAVE_WEIGHT_COPIES=$w FP4COMPILE_DQ_OPERANDS=$d step "step_$t" 100 python bench/train_step.py \
        --policy full_stack --modes reduce-overhead --steps 30 --warmup 3 --skip-bf16 --json "$OUT/train_step_$t.jsonl"
  done ;;
r46_ab)
  # issues 2, 3 on one nvidia-h200 (~4 min; session 31): RTN 4/6 on magnitudes capped at 128 registers
  # (docs/bench_logs/session31_rtn46_magnitudes_capped.diff: session 28's candidate plus CONFIG s_maxnreg 128; static
  # sm_90 with the s_* tile: 58.0 -> 49.0 instructions per element at 128 registers, no spill; uncapped it takes
  # 168). Session 28 timed that candidate (uncapped) by `cd .ab/cand && git apply`, which in a git checkout's
  # subfolder applies nothing (the first line says whether this tree is one). The candidate under .ab/cand46: its GPU
  # bit-exactness tests, the 4/6 sweep (default, uncapped, 96, tiles) of this tree and the candidate alternating, the
  # step of both
  [ -e .git ] && echo "this tree is a git checkout" || echo "this tree has no .git"
  rm -rf .ab/cand46 && mkdir -p .ab/cand46 && cp -r fp4compile bench tests .ab/cand46/ && \
    { git apply --directory=.ab/cand46 docs/bench_logs/session31_rtn46_magnitudes_capped.diff || ( cd .ab/cand46 && \
      patch -p1 < ../../docs/bench_logs/session31_rtn46_magnitudes_capped.diff ); } > "$OUT/patch46.log" 2>&1
  grep -c "_e2m1_mag_magic(alo" .ab/cand46/fp4compile/kernels/quantize.py
  ( cd .ab/cand46 && export PYTHONPATH=$PWD && step cand46_tests 150 python -m pytest -m gpu -x -q \
      -p no:cacheprovider tests/test_quantize_kernels.py -k "bit_exact_large or register_capped or pdl" )
  for t in head cand head2 cand2; do
    case $t in cand*) P=$PWD/.ab/cand46;; *) P=$PWD;; esac
    ( cd "$P" && export PYTHONPATH=$P && step "rtn46_$t" 60 python bench/quantize.py --sweep --sweeps rtn46 \
        --no-eager --out "$OUT/rtn46_$t" )
  done
  step_cand_ab cand46 ;;
s31_next)
  # issues 4, 2, 3 on one nvidia-h200 (~7 min; prepared in session 30): the attention GPU tests with the dQ kernel's
  # default at 2 stages / 128 registers (session 30 checked it by digest only), its kernel times, the MS-EDEN pass-1
  # sweep around the 96-register default (16x128 tile on 2 warps: 40.5 instead of 40.8 static instructions per
  # element, 225.8 vs 230.9 us uncapped in session 30), then the full-stack step profiled against BF16
  step attn_tests 140 python -m pytest -m gpu -x -q -p no:cacheprovider tests/test_attention.py
  PYTHONPATH=$PWD step attn_kernels 60 python bench/attention_kernels_at.py --label head --sass
  step sweeps 200 python bench/quantize.py --sweep --sweeps had128e,transposed --no-eager --out "$OUT/sweeps"
  step step_full_stack 150 python bench/train_step.py --policy full_stack --modes reduce-overhead --steps 30 \
      --warmup 3 --profile --json "$OUT/train_step.jsonl" ;;
attn_stages)
  # issues 4, 5 on one nvidia-h200 (~4 min; session 30): the backward kernels at 2 pipeline stages (49-50 KB of shared
  # memory: 4 programs per SM by memory) with register caps (static sm_90: dQ 157 -> 128 registers, 5 spilled words;
  # dK/dV 185 -> 128, 32 spilled words; at 168, 3 per SM, 3336 instead of 3896 instructions), each against the
  # default (dK/dV capped at 168, 3 stages), alternating
  Q='{"dq": {"num_stages": 2, "maxnreg": 128}}'; K='{"dkdv": {"num_stages": 2, "maxnreg": 128}}'
  attn_configs attn 16,12,1024,64 head "dq2c128=$Q" "dkdv2c128=$K" 'dkdv2c168={"dkdv": {"num_stages": 2, "maxnreg": 168}}' \
      head2 "dq2c128b=$Q" "dkdv2c128b=$K"
  # issue 5: the Q-AdamW kernel capped at 96 / 80 / 64 registers (FP4COMPILE_QADAMW_MAXNREG; uncapped 128: 8
  # programs of 2 warps per SM), alternating with the default, then its GPU test (bit-exact vs the reference) at 80
  for c in 0 96 80 64 0b 96b 80b 64b; do
    FP4COMPILE_QADAMW_MAXNREG=${c%b} step "optim_r$c" 40 python bench/optim.py --skip check,profile,warps,peak,root \
        --out "$OUT/optim_r$c.json"
  done
  FP4COMPILE_QADAMW_MAXNREG=80 step optim_test_r80 100 python -m pytest -m gpu -x -q -p no:cacheprovider \
      tests/test_optim_fused.py ;;
s30_ab)
  # issues 4, 3, 2 on one nvidia-h200 (~8 min; session 30): the dK/dV kernel's register cap (168, now the default
  # at D = 64 with the paper split): the attention GPU tests, the attention table against SDPA; then the full-stack
  # step profiled (with BF16) and profiled with MS-EDEN pass 1 capped at 96 / 80 registers (--quantize-config),
  # then 0 / 96 alternating without the profiler
  step attn_tests 140 python -m pytest -m gpu -x -q -p no:cacheprovider tests/test_attention.py
  step attn_table 90 python bench/attention.py --phase table --json "$OUT/attn_table.json"
  step step_full_stack 120 python bench/train_step.py --policy full_stack --modes reduce-overhead --steps 20 \
      --warmup 3 --profile --json "$OUT/train_step.jsonl"
  for c in 96 80; do
    step "step_prof_e$c" 70 python bench/train_step.py --policy full_stack --modes reduce-overhead --steps 20 \
        --warmup 3 --profile --skip-bf16 --quantize-config "{\"e_maxnreg\": $c}" --json "$OUT/train_step_e$c.jsonl"
  done
  for t in 0 96 0b 96b; do
    step "step_e$t" 50 python bench/train_step.py --policy full_stack --modes reduce-overhead --steps 30 \
        --warmup 3 --skip-bf16 --quantize-config "{\"e_maxnreg\": ${t%b}}" --json "$OUT/train_step_e$t.jsonl"
  done ;;
trim_ab)
  # issues 2, 3, 5 on one nvidia-h200 (~6 min): a static-only trim (session 29: _mag_value_magic by one shift,
  # MS-EDEN pass 1 RHT-128 41.8 -> 40.8 SASS instructions per element, Q-AdamW 4120 -> 4056 per thread) against the
  # tree under .ab/old (git archive 7c3c7a8^ fp4compile bench): GPU bit-exactness of the quantize kernels and the
  # fused optimizer, the quantize bench and Q-AdamW of both (alternating), the full-stack step of both
  step quant_tests 150 python -m pytest -m gpu -x -q -p no:cacheprovider tests/test_quantize_kernels.py \
      -k "ms_eden or bit_exact_large or both"
  step optim_tests 120 python -m pytest -m gpu -x -q -p no:cacheprovider tests/test_optim_fused.py
  for t in new old new2 old2; do
    case $t in old*) P=$PWD/.ab/old;; *) P=$PWD;; esac
    ( cd "$P" && export PYTHONPATH=$P && step "quant_bench_$t" 60 python bench/quantize.py --bench --no-eager \
        --out "$OUT/q_$t" && step "optim_$t" 60 python bench/optim.py --skip check,profile,warps,peak,root \
        --out "$OUT/optim_$t.json" )
  done
  step_ab 130 90 ;;
qflat_ab)
  # issues 5 + 3 on one nvidia-h200 (~8 min; session 29): Q-AdamW's RHT signs applied as sign-bit XORs (no I2F:
  # static sm_90 I2F 96 -> 32 per thread, same instruction count) against the tree under .ab/old (git archive
  # HEAD fp4compile bench), and the candidate under .ab/u (also the SR uniforms by bit placement: no I2F, +64
  # instructions), alternating; the fused optimizer's GPU test; the TMA GEMM tiles' GPU test (now with the
  # flattened 128x256x64 entry); the full-stack step of this tree (profiled) and of .ab/old
  for t in old new u old2 new2 u2; do
    case $t in old*) P=$PWD/.ab/old;; u*) P=$PWD/.ab/u;; *) P=$PWD;; esac
    ( cd "$P" && export PYTHONPATH=$P && step "optim_$t" 60 python bench/optim.py --skip check,profile,warps,peak,root \
        --out "$OUT/optim_$t.json" )
  done
  step optim_tests 120 python -m pytest -m gpu -x -q -p no:cacheprovider tests/test_optim_fused.py
  step gemm_tests 90 python -m pytest -m gpu -x -q -p no:cacheprovider tests/test_gemm.py -k "splitk_and_tma"
  step_ab 130 90 ;;
decode_ab)
  # issues 2-5 on one nvidia-h200 (~8 min): _mag_value_magic by bit placement (session 28, static sm_90: MS-EDEN
  # pass 1 43.8 -> 41.8 instructions per element and 128 -> 106 registers, Q-AdamW kernel 2 276 -> 258) and the
  # Q-Attn quantizer's codes by _e2m1_mag_magic (2656 -> 1928 instructions) and MS-EDEN pass 2 over flat scales
  # (62 instead of 83-167 instructions per entry at the step's widths) against the tree under .ab/old (their
  # parent: git archive 6c14c11^ fp4compile bench); and the candidate
  # docs/bench_logs/session28_rtn46_magnitudes.diff (RTN 4/6's two candidates on magnitudes, kept as magic floats:
  # 58.0 -> 51.2 instructions per element but 128 -> 168 registers) applied to a copy under .ab/cand: GPU
  # bit-exactness of this tree's and the candidate's quantize kernels and of the fused optimizer, the quantize
  # bench of all three, Q-AdamW of both, the full-stack step of this tree and the old one
  rm -rf .ab/cand && mkdir -p .ab/cand && cp -r fp4compile bench tests .ab/cand/ && \
    git apply --directory=.ab/cand docs/bench_logs/session28_rtn46_magnitudes.diff || echo "candidate did not apply"
  step quant_tests 150 python -m pytest -m gpu -x -q -p no:cacheprovider tests/test_quantize_kernels.py \
      -k "ms_eden or bit_exact_large"
  ( cd .ab/cand && export PYTHONPATH=$PWD && step quant_tests_cand 120 python -m pytest -m gpu -x -q \
      -p no:cacheprovider tests/test_quantize_kernels.py -k "bit_exact_large or pdl" )
  step optim_tests 100 python -m pytest -m gpu -x -q -p no:cacheprovider tests/test_optim_fused.py
  step attn_tests 120 python -m pytest -m gpu -x -q -p no:cacheprovider tests/test_attention.py
  step quant_bench 60 python bench/quantize.py --bench --no-eager
  ( cd .ab/old && export PYTHONPATH=$PWD && step quant_bench_old 60 python bench/quantize.py --bench --no-eager \
      --out "$OUT/old" )
  ( cd .ab/cand && export PYTHONPATH=$PWD && step quant_bench_cand 60 python bench/quantize.py --bench --no-eager \
      --out "$OUT/cand" )
  step optim 40 python bench/optim.py --skip check,profile,warps,peak,root --out "$OUT/optim.json"
  ( cd .ab/old && export PYTHONPATH=$PWD && step optim_old 40 python bench/optim.py \
      --skip check,profile,warps,peak,root --out "$OUT/optim_old.json" )
  step_ab 120 90 ;;
attn_bisect)
  # issue 4 (~2 min): the Q-Attn kernels' device time at the step's shape for each tree under .ab/<rev> named in
  # BISECT (default: every tree there, oldest first as listed in .ab/ORDER), this tree first and last; ATTN_SASS=1:
  # also the launched backward kernels' SASS digests and the offline compile's (session 29's dK/dV question:
  # ATTN_SASS=1 BISECT=05bb13a with .ab/05bb13a = git archive 05bb13a fp4compile, and .ab/cand from
  # docs/bench_logs/session28_dkdv_contig.diff)
  for t in head ${BISECT:-$(cat .ab/ORDER 2>/dev/null)} head2; do
    if [ "${t:0:4}" = head ]; then P=$PWD; else P=$PWD/.ab/$t; fi
    PYTHONPATH=$P step "attn_at_$t" 90 python bench/attention_kernels_at.py --label "$t" ${ATTN_SASS:+--sass}
  done ;;
attn_step)
  # issue 4 + 3 on one nvidia-h200 (~7 min): the attention table of this tree and of an older one carried under
  # .ab/old (same default tiles, same process order), per-kernel device time of both (--phase profile), then the
  # GPT-124M training step with CUDA graphs, full stack (incl. Q-Attn) and quartet2, each against BF16
  step attn_table 80 python bench/attention.py --phase table --json "$OUT/attn_new.json"
  step attn_profile 80 python bench/attention.py --phase profile --json "$OUT/attn_profile_new.json"
  if [ -d .ab/old/fp4compile ]; then
    ( cd .ab/old && export PYTHONPATH=$PWD && step attn_table_old 80 python bench/attention.py --phase table \
        --json "$OUT/attn_old.json" )
    cp bench/attention.py .ab/old/bench/attention_profile.py 2>/dev/null
    ( cd .ab/old && export PYTHONPATH=$PWD && step attn_profile_old 80 python bench/attention_profile.py \
        --phase profile --json "$OUT/attn_profile_old.json" )
  fi
  step step_full_stack 200 python bench/train_step.py --policy full_stack --modes reduce-overhead --steps 20 \
      --warmup 3 --profile --json "$OUT/train_step.jsonl"
  step step_quartet2 170 python bench/train_step.py --policy quartet2 --modes reduce-overhead --steps 20 \
      --warmup 3 --json "$OUT/train_step.jsonl" ;;
dist_cg)
  # issue 8 with CUDA graphs: 1 GPU vs DDP on 2 GPUs, both with mode=reduce-overhead (FSDP2 has none)
  CUDA_VISIBLE_DEVICES=0 step dist_1gpu_cg 120 python bench/distributed.py --model 124m --parallel none \
      --mode reduce-overhead --json "$OUT/dist_none_cg.json"
  step dist_ddp_cg 150 torchrun --nproc-per-node 2 bench/distributed.py --model 124m --parallel ddp \
      --mode reduce-overhead --json "$OUT/dist_ddp_cg.json" ;;
esac
for f in "$OUT"/*.log; do echo "=== $(basename "$f")"; tail -n 25 "$f"; done 2>/dev/null | tail -c 11000
# the device returns at most 8 files: pack everything into one, $OUT/run_h200.tgz (session 48: a caller's own
# `tar czf out.tgz .` after this used to overwrite the pack, then named out.tgz, with an empty archive; a pack of
# its own name survives such a tar, inside it)
( cd "$OUT" && tar czf /tmp/run_h200.tgz . && find . -mindepth 1 -delete && mv /tmp/run_h200.tgz . )
