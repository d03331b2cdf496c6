from mtrain.cli import main

main()
