"""Checks a `docker save` archive of the wasm image: one layer, holding only
plugin.wasm, byte for byte the module `make wasm` built.
Usage: check-wasm-image.py IMAGE.tar MODULE.wasm"""
import hashlib
import json
import sys
import tarfile

image_tar, module = sys.argv[1], sys.argv[2]
with tarfile.open(image_tar) as image:
    manifest = json.load(image.extractfile("manifest.json"))
    layers = manifest[0]["Layers"]
    if len(layers) != 1:
        sys.exit(f"the image has {len(layers)} layers, Istio's image format wants one: {layers}")
    with tarfile.open(fileobj=image.extractfile(layers[0])) as layer:
        files = [m.name for m in layer.getmembers() if not m.isdir()]
        if files != ["plugin.wasm"]:
            sys.exit(f"the layer holds {files}, not just plugin.wasm")
        in_image = hashlib.sha256(layer.extractfile("plugin.wasm").read()).hexdigest()
with open(module, "rb") as f:
    built = hashlib.sha256(f.read()).hexdigest()
if in_image != built:
    sys.exit(f"plugin.wasm in the image is sha256:{in_image}, {module} is sha256:{built}")
print(f"wasm image: one layer, /plugin.wasm = {module} (sha256:{built})")
