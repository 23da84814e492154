# XLA:CPU flags vs compile time (results/suite_timing_2026-12-08.txt (5)); run from the repository root: bash results/xla_flags_2026-12-08/run.sh
V=("" "--xla_cpu_parallel_codegen_split_count=1" "--xla_cpu_disable_loop_unrolling=true" "--xla_cpu_use_fusion_emitters=false" "--xla_cpu_disable_slp_vectorizer=true" "--xla_cpu_optimize_for_size=true" "--xla_cpu_experimental_ynn_fusion_type=" "--xla_llvm_disable_expensive_passes=true --xla_cpu_disable_loop_unrolling=true --xla_cpu_disable_slp_vectorizer=true")
for rep in 1 2; do
  if [ $rep = 1 ]; then order="0 1 2 3 4 5 6 7"; else order="7 6 5 4 3 2 1 0"; fi
  for i in $order; do XLA_FLAGS="${V[$i]}" JAX_PLATFORMS=cpu PYTHONPATH=. timeout 300 .venv/bin/python results/xla_flags_2026-12-08/bench.py 2>&1 | tail -1; done
done
