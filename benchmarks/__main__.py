"""python -m benchmarks list | QUESTION [--dry-run] [--out DIR] [--hardware NAME] [the question's options]"""

import sys

from benchmarks import runner

sys.exit(runner.main(sys.argv[1:]))
