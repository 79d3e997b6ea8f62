import sys

from dpkern.cli.__main__ import main

sys.exit(main())
