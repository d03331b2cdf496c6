from mtrain.cli import app

app(prog_name="mtrain")
