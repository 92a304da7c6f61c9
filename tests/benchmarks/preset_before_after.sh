#!/usr/bin/env bash
# The CPU preset (recipes/grpo_gsm8k.py --preset cpu) under /usr/bin/time -v, first on an older commit
# (a git worktree) and then on this checkout, one after the other, printing wall, user and system time,
# peak RSS, page faults and the recipe's summary line of each.
#
#   bash tests/benchmarks/preset_before_after.sh [BEFORE_COMMIT] [extra recipe flags...]
#
# BEFORE_COMMIT defaults to dda1bc2 (main before the chunked LM head: the code issue 16 was filed on).
set -euo pipefail
cd "$(dirname "$0")/../.."
before=${1:-dda1bc2}
shift || true
out=$(mktemp -d)
git worktree add --detach "$out/before" "$before" >/dev/null
trap 'git worktree remove --force "$out/before"' EXIT
for which in before after; do
  dir=$([ "$which" = before ] && echo "$out/before" || pwd)
  echo "== $which $(git -C "$dir" rev-parse --short HEAD) $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
  (cd "$dir" && PYTHONPATH="$dir" /usr/bin/time -v python recipes/grpo_gsm8k.py --preset cpu --no-progress-bar \
      --output-dir "$out/$which" "$@" > "$out/$which.log" 2>&1)
  grep -E "Elapsed|User time|System time|Maximum resident|Minor" "$out/$which.log"
  grep "done:" "$out/$which.log" | tail -1
done
echo "logs and metrics: $out"
