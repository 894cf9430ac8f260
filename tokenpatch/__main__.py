import sys

from tokenpatch.workbench.cli.main import main

sys.exit(main())
