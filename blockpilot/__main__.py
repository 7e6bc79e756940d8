import sys

from blockpilot.cli import main

sys.exit(main())
