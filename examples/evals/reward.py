"""The reward function in Python, for baselines that have it (same result as reward.sh).

Usage inside the guest: python3 reward.py EXPECTED ANSWER  -> prints a number in [0, 1]
"""

import sys
from pathlib import Path

expected_path, answer_path = Path(sys.argv[1]), Path(sys.argv[2])
want = expected_path.read_text().splitlines()
got = answer_path.read_text().splitlines() if answer_path.exists() else []
matches = sum(1 for i, line in enumerate(want) if i < len(got) and got[i] == line)
print(f"{matches / len(want) if want else 0:.4f}")
