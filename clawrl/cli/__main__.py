from clawrl.cli import app

app(prog_name="clawrl")
