#include "attention/mixer.h"

#include "attention/dense.h"
#include "util/error.h"

namespace kvx::attention {

std::vector<std::string> mixer_kinds() { return {"dense"}; }

std::shared_ptr<Mixer> make_mixer(const std::string& kind, const model::ModelConfig& config, int layer) {
  if (kind == "dense") return std::make_shared<DenseAttention>(config, layer);
  std::string valid;
  for (const auto& k : mixer_kinds()) valid += (valid.empty() ? "" : ", ") + k;
  throw Error("unknown mixer kind '" + kind + "' in layout (valid: " + valid + ")");
}

}  // namespace kvx::attention
