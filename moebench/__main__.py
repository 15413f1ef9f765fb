from moebench.cli import main

raise SystemExit(main())
