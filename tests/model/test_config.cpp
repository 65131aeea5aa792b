#include <gtest/gtest.h>

#include "model/config.h"
#include "util/error.h"

using namespace kvx;

namespace {
std::string error_of(const nlohmann::json& j) {
  try {
    model::ModelConfig::from_json(j);
  } catch (const kvx::Error& e) {
    return e.what();
  }
  return "";
}
nlohmann::json good() { return model::ModelConfig{}.to_json(); }
}  // namespace

TEST(ModelConfig, RoundTripsThroughJson) {
  model::ModelConfig c;
  c.num_key_value_heads = 2;
  c.layout = "dense*4";
  auto d = model::ModelConfig::from_json(c.to_json());
  EXPECT_EQ(d.to_json(), c.to_json());
}

TEST(ModelConfig, UnknownKeysAreRejectedByName) {
  auto j = good();
  j["num_heads"] = 4;
  auto err = error_of(j);
  EXPECT_NE(err.find("unknown key 'num_heads'"), std::string::npos) << err;
  EXPECT_NE(err.find("num_attention_heads"), std::string::npos) << err;  // lists the known keys
}

TEST(ModelConfig, BadValuesNameTheFix) {
  auto j = good();
  j["num_key_value_heads"] = 3;
  EXPECT_NE(error_of(j).find("must divide"), std::string::npos);
  j = good();
  j["head_dim"] = 7;
  EXPECT_NE(error_of(j).find("even"), std::string::npos);
  j = good();
  for (const nlohmann::json bad : {nlohmann::json("wide"), nlohmann::json(2e57), nlohmann::json(1.5), nlohmann::json(1ull << 40)}) {
    j["hidden_size"] = bad;  // never converted silently (2e57 used to overflow inside the JSON library)
    EXPECT_NE(error_of(j).find("'hidden_size' must be an integer in [-2147483648, 2147483647], got"), std::string::npos)
        << error_of(j);
  }
  j = good();
  j.erase("vocab_size");
  EXPECT_NE(error_of(j).find("missing required key 'vocab_size'"), std::string::npos);
  j = good();
  j["layout"] = "dense*3";
  EXPECT_NE(error_of(j).find("describes 3 layers"), std::string::npos);
}

TEST(Layout, Expands) {
  EXPECT_EQ(model::expand_layout("dense", 3), (std::vector<std::string>{"dense", "dense", "dense"}));
  EXPECT_EQ(model::expand_layout("a*2,b", 3), (std::vector<std::string>{"a", "a", "b"}));
  EXPECT_THROW(model::expand_layout("a*0", 1), kvx::Error);
  EXPECT_THROW(model::expand_layout("a*2x", 2), kvx::Error);  // trailing junk after the count
  EXPECT_THROW(model::expand_layout("a", 428207405), kvx::Error);  // found by fuzzing: 428M layer entries
  try {  // a huge count is refused before anything is expanded (found by fuzzing: it ran out of memory)
    model::expand_layout("a*99999999", 4);
    ADD_FAILURE() << "no error";
  } catch (const kvx::Error& e) {
    EXPECT_NE(std::string(e.what()).find("more than num_hidden_layers = 4"), std::string::npos) << e.what();
  }
  EXPECT_THROW(model::expand_layout("a*x", 1), kvx::Error);
  model::ModelConfig c;  // the config names the mixer kinds it knows
  c.num_hidden_layers = 2;
  c.layout = "dense,lla";
  try {
    c.validate();
    ADD_FAILURE() << "an unknown mixer kind was accepted";
  } catch (const kvx::Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown mixer kind 'lla'"), std::string::npos) << e.what();
  }
}

TEST(ModelConfig, FamilySettingsOnlyWhereUsed) {
  model::ModelConfig c;
  EXPECT_FALSE(c.to_json().contains("lrkv_rank"));  // a dense config stays a plain Llama-style one
  c.layout = "lrkv*2,dense*2";
  c.lrkv_rank = 24;
  c.lrkv_rope = "pair_aligned";
  auto j = c.to_json();
  EXPECT_EQ(j["lrkv_rank"], 24);
  EXPECT_FALSE(j.contains("kv_lora_rank"));
  auto d = model::ModelConfig::from_json(j);
  EXPECT_EQ(d.lrkv_rope, "pair_aligned");
  EXPECT_TRUE(d.uses("lrkv"));
  EXPECT_FALSE(d.uses("mla"));
}

TEST(ModelConfig, FamilySettingsAreValidated) {
  auto j = good();
  j["layout"] = "lrkv";
  j["lrkv_rank"] = j["head_dim"].get<int>() + 1;
  EXPECT_NE(error_of(j).find("lrkv_rank"), std::string::npos) << error_of(j);
  j["lrkv_rank"] = 7;
  j["lrkv_rope"] = "pair_aligned";
  EXPECT_NE(error_of(j).find("even"), std::string::npos) << error_of(j);
  j["lrkv_rope"] = "full";
  EXPECT_NE(error_of(j).find("expand, shared_rope, pair_aligned"), std::string::npos) << error_of(j);
  auto m = good();
  m["layout"] = "mla";
  m["qk_rope_head_dim"] = 3;
  EXPECT_NE(error_of(m).find("qk_rope_head_dim"), std::string::npos) << error_of(m);
}
