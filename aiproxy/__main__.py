from aiproxy.cli import main

raise SystemExit(main())
