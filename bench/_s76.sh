# session 76 device call: A_TMA checks, GEMM table, and (if A_TMA's kernel-only step sum wins) a step A/B
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 60 python bench/_dbg_atma.py 256 256 1024 2>&1 | tail -1
python -m pytest -q -m gpu tests/test_gemm_wgmma.py -k "atma" 2>&1 | tail -3
python bench/gemm_wgmma.py --kinds mixed --only 124M,square --rep 20 --match '128x256x64w4 mixed halves split b4$|atma' 2>&1 | tee $OUT/bench1.txt | tail -16
python - <<'P' > $OUT/win.txt
import re
t = open(__import__("os").environ["OUT"] + "/bench1.txt").read()
m = re.search(r"124M step.*", t).group(0)
d = float(re.search(r"kernel only 128x256x64w4 mixed halves split b4 ([\d.]+)", m).group(1))
a = float(re.search(r"kernel only 128x256x64w4 mixed halves split b4 atma ([\d.]+)", m).group(1))
print("win" if a < d else "lose", d, a)
P
cat $OUT/win.txt
left=$((${STEP_AB_UNTIL:-585} - SECONDS))
echo "seconds left for the step A/B: $left"
if grep -q win $OUT/win.txt && [ $left -gt 200 ]; then
  timeout $left python bench/step_ab.py --policy quartet2 --rounds 6 --arm atma --arm 'ldg:fp4compile.kernels.gemm.MIXED_DEFAULT[A_TMA]=false' 2>&1 | tee $OUT/ab.txt | tail -12
fi
