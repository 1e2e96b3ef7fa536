"""Print the mutation score of the last `make mutation` run (mutmut's CI/CD stats).

score = killed / (killed + survived + timeout + suspicious): mutants no test
covers (``no_tests``) and skipped ones are listed but not counted, as mutmut
does. The issue's target is >= 85% on lab/rules, lab/diagnostics, lab/train and
the kernels' dispatcher and reference. Survivors judged equivalent (the mutant
cannot change behaviour) are listed with reasons in the README.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stats", default="mutants/mutmut-cicd-stats.json",
                        help="mutmut's CI/CD stats file (default: %(default)s)")
    path = Path(parser.parse_args(argv).stats)
    if not path.exists():
        print(f"{path} not found: run `make mutation` (mutmut run, then mutmut export-cicd-stats)")
        return 1
    s = json.loads(path.read_text())
    counted = s["killed"] + s["survived"] + s["timeout"] + s["suspicious"]
    score = s["killed"] / counted if counted else float("nan")
    print(f"mutants: {s['total']} (killed {s['killed']}, survived {s['survived']}, "
          f"timeout {s['timeout']}, suspicious {s['suspicious']}, no tests {s['no_tests']}, "
          f"skipped {s['skipped']})")
    print(f"mutation score: {100 * score:.1f}% (target >= 85%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
