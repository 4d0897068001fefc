import sys

from treecompile.cli import main

sys.exit(main())
