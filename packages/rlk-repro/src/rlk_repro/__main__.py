import sys

from rlk_repro.cli import main

sys.exit(main())
