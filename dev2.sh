export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 280 python benchmarks/engine_bench.py --only throughput --variants engine,engine_overlap_update --rounds 7 --steps 8 --out $OUT/overlap_update_h100.json > $OUT/overlap.log 2>&1; tail -6 $OUT/overlap.log
timeout 280 python benchmarks/engine_bench.py --only throughput --variants engine,engine_fp8 --rounds 5 --out $OUT/bf16_fp8_vs_plain_h100.json > $OUT/e1.log 2>&1; tail -6 $OUT/e1.log
