"""Write tests/data/hub_v0.2/ with collab-vit 0.2 (main at c2a1b61): a tiny converted ViT saved by save_pretrained."""
import sys, torch, timm
from safetensors.torch import save_file
import collab_vit

out = sys.argv[1]
torch.set_num_threads(1)
torch.manual_seed(0)
model = timm.create_model("vit_small_patch16_224", img_size=16, patch_size=8, depth=2, embed_dim=32, num_heads=2,
                          num_classes=5, reg_tokens=1, init_values=1e-5).eval()
with torch.no_grad():
    for name, p in model.named_parameters():
        if name.endswith(("bias", "gamma")):
            p.normal_(0, 0.2)
collab_vit.reparametrize_layers(model, key_dim=[16, 24], progress=False)
print(collab_vit.save_pretrained(model, f"{out}/folder"))
x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    logits = model(x)
save_file({"input": x, "logits": logits}, f"{out}/expected.safetensors")
print(collab_vit.__version__, logits)
