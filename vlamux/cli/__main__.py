from vlamux.cli import main

main()
