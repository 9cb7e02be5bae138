#include "data/jinja_parser.h"

#include <charconv>
#include <cstdlib>
#include <initializer_list>
#include <string>

#include "base/untrusted_text.h"
#include "data/jinja_error.h"
#include "data/jinja_lexer.h"

namespace strata::data::jinja {
namespace {

using ExprPtr = std::unique_ptr<Expr>;

bool IsOneOf(std::string_view s, std::initializer_list<std::string_view> names) {
  for (std::string_view n : names) {
    if (s == n) return true;
  }
  return false;
}

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : tokens_(std::move(tokens)) {}

  StmtList Run(bool* has_generation) {
    StmtList body = ParseStatements({});
    if (Peek().type != TokenType::kEnd) Fail(Peek().line, "unexpected '" + Describe(Peek()) + "'");
    *has_generation = has_generation_;
    return body;
  }

 private:
  // Nesting guard: statements and expressions each count one level.
  struct DepthGuard {
    explicit DepthGuard(Parser* p) : p(p) {
      if (++p->depth_ > kMaxParseDepth) {
        Fail(p->Peek().line,
             "template nested deeper than " + std::to_string(kMaxParseDepth) + " levels");
      }
    }
    ~DepthGuard() { --p->depth_; }
    Parser* p;
  };

  const Token& Peek(size_t ahead = 0) const {
    const size_t k = std::min(pos_ + ahead, tokens_.size() - 1);
    return tokens_[k];
  }
  const Token& Next() {
    const Token& t = tokens_[pos_];
    if (pos_ + 1 < tokens_.size()) ++pos_;
    return t;
  }
  static std::string Describe(const Token& t) {
    switch (t.type) {
      case TokenType::kText:
        return "text";
      case TokenType::kVarBegin:
        return "{{";
      case TokenType::kVarEnd:
        return "}}";
      case TokenType::kBlockBegin:
        return "{%";
      case TokenType::kBlockEnd:
        return "%}";
      case TokenType::kEnd:
        return "end of template";
      default:
        return Excerpt(t.value);
    }
  }
  bool IsOp(std::string_view op, size_t ahead = 0) const {
    return Peek(ahead).type == TokenType::kOperator && Peek(ahead).value == op;
  }
  bool IsName(std::string_view name, size_t ahead = 0) const {
    return Peek(ahead).type == TokenType::kName && Peek(ahead).value == name;
  }
  bool SkipOp(std::string_view op) {
    if (!IsOp(op)) return false;
    Next();
    return true;
  }
  bool SkipName(std::string_view name) {
    if (!IsName(name)) return false;
    Next();
    return true;
  }
  [[noreturn]] void Unexpected(std::string_view expected) const {
    const Token& t = Peek();
    if (t.type == TokenType::kEnd) {
      Fail(t.line, "unexpected end of template, expected " + std::string(expected));
    }
    Fail(t.line, "expected " + std::string(expected) + ", got '" + Describe(t) + "'");
  }
  void ExpectOp(std::string_view op) {
    if (!SkipOp(op)) Unexpected("'" + std::string(op) + "'");
  }
  std::string ExpectName() {
    if (Peek().type != TokenType::kName) Unexpected("a name");
    return Next().value;
  }
  void ExpectBlockEnd() {
    if (Peek().type != TokenType::kBlockEnd) Unexpected("'%}'");
    Next();
  }

  // Statements up to a `{% name %}` whose name is one of `ends` (not consumed: the tag's
  // `{%` and name are left for the caller), or to the end of the template when `ends` is empty.
  StmtList ParseStatements(std::initializer_list<std::string_view> ends) {
    DepthGuard guard(this);
    StmtList out;
    while (true) {
      const Token& t = Peek();
      if (t.type == TokenType::kEnd) {
        if (ends.size() == 0) return out;
        std::string names;
        for (std::string_view e : ends)
          names += (names.empty() ? "'" : " or '") + std::string(e) + "'";
        Fail(t.line, "unexpected end of template, expected " + names);
      }
      if (t.type == TokenType::kText) {
        auto s = std::make_unique<Stmt>();
        s->kind = StmtKind::kText;
        s->line = t.line;
        s->text = Next().value;
        out.push_back(std::move(s));
      } else if (t.type == TokenType::kVarBegin) {
        auto s = std::make_unique<Stmt>();
        s->kind = StmtKind::kOutput;
        s->line = Next().line;
        s->expr = ParseTuple(true);
        if (Peek().type != TokenType::kVarEnd) Unexpected("'}}'");
        Next();
        out.push_back(std::move(s));
      } else if (t.type == TokenType::kBlockBegin) {
        if (Peek(1).type == TokenType::kName) {
          for (std::string_view e : ends) {
            if (Peek(1).value == e) {
              Next();
              return out;
            }
          }
        }
        Next();
        out.push_back(ParseStatement());
      } else {
        Fail(t.line, "unexpected '" + Describe(t) + "'");
      }
    }
  }

  // After `{% name %}` was left by ParseStatements: consumes the name and the `%}`.
  void EndTag(std::string_view name) {
    if (!SkipName(name)) Unexpected("'" + std::string(name) + "'");
    ExpectBlockEnd();
  }

  std::unique_ptr<Stmt> ParseStatement() {
    const Token& t = Peek();
    if (t.type != TokenType::kName) Fail(t.line, "tag name expected");
    const std::string tag = t.value;
    auto s = std::make_unique<Stmt>();
    s->line = t.line;
    Next();
    if (tag == "if") {
      ParseIfRest(s.get());
    } else if (tag == "for") {
      ParseFor(s.get());
    } else if (tag == "set") {
      ParseSet(s.get());
    } else if (tag == "macro") {
      ParseMacro(s.get());
    } else if (tag == "break" || tag == "continue") {
      if (loop_depth_ == 0) Fail(t.line, "'" + tag + "' outside of a loop");
      s->kind = tag == "break" ? StmtKind::kBreak : StmtKind::kContinue;
      ExpectBlockEnd();
    } else if (tag == "generation") {
      s->kind = StmtKind::kGeneration;
      has_generation_ = true;
      ExpectBlockEnd();
      s->body = ParseStatements({"endgeneration"});
      EndTag("endgeneration");
    } else if (tag == "filter") {
      s->kind = StmtKind::kFilterBlock;
      ParseFilterChain(&s->filters);
      ExpectBlockEnd();
      s->body = ParseStatements({"endfilter"});
      EndTag("endfilter");
    } else if (IsOneOf(tag, {"endif", "endfor", "endset", "endmacro", "endgeneration", "endfilter",
                             "else", "elif"})) {
      Fail(t.line, "unexpected '" + tag + "' tag");
    } else {
      Fail(t.line, "unknown tag '" + Excerpt(tag) + "'");
    }
    return s;
  }

  void ParseIfRest(Stmt* s) {
    s->kind = StmtKind::kIf;
    s->expr = ParseTuple(false);
    ExpectBlockEnd();
    s->body = ParseStatements({"elif", "else", "endif"});
    if (SkipName("elif")) {
      auto elif = std::make_unique<Stmt>();
      elif->line = tokens_[pos_ - 1].line;
      ParseIfRest(elif.get());
      s->else_body.push_back(std::move(elif));
      return;  // the nested if consumed endif
    }
    if (SkipName("else")) {
      ExpectBlockEnd();
      s->else_body = ParseStatements({"endif"});
    }
    EndTag("endif");
  }

  void ParseAssignTargets(Stmt* s, bool allow_attr) {
    s->targets.push_back(ExpectName());
    if (allow_attr && SkipOp(".")) {
      s->text = ExpectName();
      return;
    }
    while (SkipOp(",")) {
      s->tuple_target = true;
      if (Peek().type != TokenType::kName) break;
      s->targets.push_back(ExpectName());
    }
  }

  void ParseFor(Stmt* s) {
    s->kind = StmtKind::kFor;
    ParseAssignTargets(s, false);
    if (!SkipName("in")) Unexpected("'in'");
    s->expr = ParseTuple(false, /*in_for=*/true);
    if (SkipName("if")) s->cond = ParseExpression();
    if (IsName("recursive")) Fail(Peek().line, "recursive loops are not supported");
    ExpectBlockEnd();
    ++loop_depth_;
    s->body = ParseStatements({"endfor", "else"});
    --loop_depth_;
    if (SkipName("else")) {
      ExpectBlockEnd();
      s->else_body = ParseStatements({"endfor"});
    }
    EndTag("endfor");
  }

  void ParseSet(Stmt* s) {
    ParseAssignTargets(s, true);
    if (SkipOp("=")) {
      s->kind = StmtKind::kSet;
      s->expr = ParseTuple(true);
      ExpectBlockEnd();
      return;
    }
    if (s->tuple_target || !s->text.empty()) Unexpected("'='");
    s->kind = StmtKind::kSetBlock;
    if (IsOp("|")) ParseFilterChain(&s->filters);
    ExpectBlockEnd();
    s->body = ParseStatements({"endset"});
    EndTag("endset");
  }

  void ParseMacro(Stmt* s) {
    s->kind = StmtKind::kMacro;
    s->text = ExpectName();
    ExpectOp("(");
    while (!IsOp(")")) {
      if (!s->params.empty()) ExpectOp(",");
      if (IsOp(")")) break;
      s->params.push_back(ExpectName());
      s->defaults.push_back(SkipOp("=") ? ParseExpression() : nullptr);
    }
    ExpectOp(")");
    ExpectBlockEnd();
    const int saved = loop_depth_;
    loop_depth_ = 0;
    s->body = ParseStatements({"endmacro"});
    loop_depth_ = saved;
    EndTag("endmacro");
  }

  // `name[(args)] | name[(args)] ...` of a filter block or block set: kFilter nodes whose
  // input (args[0]) is null.
  void ParseFilterChain(std::vector<ExprPtr>* out) {
    SkipOp("|");
    do {
      auto f = std::make_unique<Expr>();
      f->kind = ExprKind::kFilter;
      f->line = Peek().line;
      f->args.push_back(nullptr);
      ParseFilterNameAndArgs(f.get());
      out->push_back(std::move(f));
    } while (SkipOp("|"));
  }

  // ---- expressions ----

  ExprPtr Make(ExprKind kind, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = line;
    return e;
  }

  ExprPtr ParseTuple(bool with_condexpr, bool in_for = false) {
    const int line = Peek().line;
    std::vector<ExprPtr> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) {
        if (!SkipOp(",")) break;
        is_tuple = true;
      }
      const Token& t = Peek();
      if (t.type == TokenType::kVarEnd || t.type == TokenType::kBlockEnd || IsOp(")") ||
          (in_for && IsName("if"))) {
        if (items.empty()) Unexpected("an expression");
        break;
      }
      items.push_back(with_condexpr ? ParseExpression() : ParseOr());
    }
    if (!is_tuple) return std::move(items[0]);
    auto e = Make(ExprKind::kTuple, line);
    e->args = std::move(items);
    return e;
  }

  ExprPtr ParseExpression() {
    DepthGuard guard(this);
    ExprPtr e = ParseOr();
    while (IsName("if")) {
      const int line = Next().line;
      auto c = Make(ExprKind::kCond, line);
      c->args.push_back(ParseOr());
      c->args.push_back(std::move(e));
      c->args.push_back(SkipName("else") ? ParseExpression() : nullptr);
      e = std::move(c);
    }
    return e;
  }

  ExprPtr Binary(ExprKind kind, ExprPtr a, ExprPtr b, int line) {
    auto e = Make(kind, line);
    e->args.push_back(std::move(a));
    e->args.push_back(std::move(b));
    return e;
  }

  ExprPtr ParseOr() {
    DepthGuard guard(this);
    ExprPtr e = ParseAnd();
    while (IsName("or")) {
      const int line = Next().line;
      e = Binary(ExprKind::kOr, std::move(e), ParseAnd(), line);
    }
    return e;
  }
  ExprPtr ParseAnd() {
    ExprPtr e = ParseNot();
    while (IsName("and")) {
      const int line = Next().line;
      e = Binary(ExprKind::kAnd, std::move(e), ParseNot(), line);
    }
    return e;
  }
  ExprPtr ParseNot() {
    DepthGuard guard(this);
    if (IsName("not")) {
      auto e = Make(ExprKind::kNot, Next().line);
      e->args.push_back(ParseNot());
      return e;
    }
    return ParseCompare();
  }
  ExprPtr ParseCompare() {
    const int line = Peek().line;
    ExprPtr first = ParseMath1();
    ExprPtr e;
    while (true) {
      CmpOp op;
      if (IsOp("==")) {
        op = CmpOp::kEq;
      } else if (IsOp("!=")) {
        op = CmpOp::kNe;
      } else if (IsOp("<")) {
        op = CmpOp::kLt;
      } else if (IsOp("<=")) {
        op = CmpOp::kLe;
      } else if (IsOp(">")) {
        op = CmpOp::kGt;
      } else if (IsOp(">=")) {
        op = CmpOp::kGe;
      } else if (IsName("in")) {
        op = CmpOp::kIn;
      } else if (IsName("not") && IsName("in", 1)) {
        Next();
        op = CmpOp::kNotIn;
      } else {
        break;
      }
      Next();
      if (!e) {
        e = Make(ExprKind::kCompare, line);
        e->args.push_back(std::move(first));
      }
      e->cmp_ops.push_back(op);
      e->args.push_back(ParseMath1());
    }
    return e ? std::move(e) : std::move(first);
  }
  ExprPtr BinOpExpr(BinOp op, ExprPtr a, ExprPtr b, int line) {
    auto e = Binary(ExprKind::kBinary, std::move(a), std::move(b), line);
    e->op = op;
    return e;
  }
  ExprPtr ParseMath1() {
    ExprPtr e = ParseConcat();
    while (IsOp("+") || IsOp("-")) {
      const BinOp op = Peek().value == "+" ? BinOp::kAdd : BinOp::kSub;
      const int line = Next().line;
      e = BinOpExpr(op, std::move(e), ParseConcat(), line);
    }
    return e;
  }
  ExprPtr ParseConcat() {
    ExprPtr e = ParseMath2();
    while (IsOp("~")) {
      const int line = Next().line;
      e = Binary(ExprKind::kConcat, std::move(e), ParseMath2(), line);
    }
    return e;
  }
  ExprPtr ParseMath2() {
    ExprPtr e = ParsePow();
    while (IsOp("*") || IsOp("/") || IsOp("//") || IsOp("%")) {
      const std::string& v = Peek().value;
      const BinOp op = v == "*"    ? BinOp::kMul
                       : v == "/"  ? BinOp::kDiv
                       : v == "//" ? BinOp::kFloorDiv
                                   : BinOp::kMod;
      const int line = Next().line;
      e = BinOpExpr(op, std::move(e), ParsePow(), line);
    }
    return e;
  }
  ExprPtr ParsePow() {
    ExprPtr e = ParseUnary(true);
    while (IsOp("**")) {
      const int line = Next().line;
      e = BinOpExpr(BinOp::kPow, std::move(e), ParseUnary(true), line);
    }
    return e;
  }
  ExprPtr ParseUnary(bool with_filter) {
    DepthGuard guard(this);
    ExprPtr e;
    if (IsOp("-") || IsOp("+")) {
      const ExprKind kind = IsOp("-") ? ExprKind::kNeg : ExprKind::kPos;
      e = Make(kind, Next().line);
      e->args.push_back(ParseUnary(false));
    } else {
      e = ParsePrimary();
    }
    e = ParsePostfix(std::move(e));
    if (with_filter) e = ParseFilterExpr(std::move(e));
    return e;
  }

  ExprPtr Const(Value v, int line) {
    auto e = Make(ExprKind::kConst, line);
    e->value = v;
    return e;
  }

  ExprPtr ParsePrimary() {
    DepthGuard guard(this);
    const Token& t = Peek();
    const int line = t.line;
    switch (t.type) {
      case TokenType::kName: {
        const std::string& n = t.value;
        if (n == "true" || n == "True") return Next(), Const(Value::Bool(true), line);
        if (n == "false" || n == "False") return Next(), Const(Value::Bool(false), line);
        if (n == "none" || n == "None") return Next(), Const(Value::None(), line);
        auto e = Make(ExprKind::kName, line);
        e->name = Next().value;
        return e;
      }
      case TokenType::kString: {
        auto e = Make(ExprKind::kConst, line);
        while (Peek().type == TokenType::kString) e->literal += Next().value;
        e->value = Value::StringView(e->literal);
        return e;
      }
      case TokenType::kInteger: {
        int64_t v = 0;
        const std::string& d = t.value;
        auto r = std::from_chars(d.data(), d.data() + d.size(), v);
        if (r.ec != std::errc()) Fail(line, "integer literal out of range");
        Next();
        return Const(Value::Int(v), line);
      }
      case TokenType::kFloat: {
        const double v = std::strtod(t.value.c_str(), nullptr);
        Next();
        return Const(Value::Float(v), line);
      }
      case TokenType::kOperator:
        if (t.value == "(") {
          Next();
          if (SkipOp(")")) {
            auto e = Make(ExprKind::kTuple, line);
            return e;
          }
          ExprPtr e = ParseTuple(true);
          ExpectOp(")");
          return e;
        }
        if (t.value == "[") {
          Next();
          auto e = Make(ExprKind::kList, line);
          while (!IsOp("]")) {
            if (!e->args.empty()) ExpectOp(",");
            if (IsOp("]")) break;
            e->args.push_back(ParseExpression());
          }
          ExpectOp("]");
          return e;
        }
        if (t.value == "{") {
          Next();
          auto e = Make(ExprKind::kDict, line);
          while (!IsOp("}")) {
            if (!e->args.empty()) ExpectOp(",");
            if (IsOp("}")) break;
            e->args.push_back(ParseExpression());
            ExpectOp(":");
            e->args.push_back(ParseExpression());
          }
          ExpectOp("}");
          return e;
        }
        break;
      default:
        break;
    }
    Unexpected("an expression");
  }

  ExprPtr ParsePostfix(ExprPtr e) {
    while (true) {
      if (IsOp(".")) {
        const int line = Next().line;
        if (Peek().type == TokenType::kInteger) {
          auto item = Make(ExprKind::kItem, line);
          item->args.push_back(std::move(e));
          item->args.push_back(ParsePrimary());
          e = std::move(item);
          continue;
        }
        auto a = Make(ExprKind::kAttr, line);
        a->name = ExpectName();
        a->args.push_back(std::move(e));
        e = std::move(a);
      } else if (IsOp("[")) {
        e = ParseSubscript(std::move(e));
      } else if (IsOp("(")) {
        e = ParseCall(std::move(e));
      } else {
        return e;
      }
    }
  }

  ExprPtr ParseSubscript(ExprPtr obj) {
    DepthGuard guard(this);
    const int line = Next().line;  // [
    ExprPtr parts[3];
    int colons = 0;
    while (!IsOp("]")) {
      if (IsOp(":")) {
        if (++colons > 2) Unexpected("']'");
        Next();
        continue;
      }
      if (parts[colons]) Unexpected("':' or ']'");
      parts[colons] = ParseExpression();
    }
    Next();  // ]
    if (colons == 0) {
      if (!parts[0]) Fail(line, "expected an expression in []");
      auto e = Make(ExprKind::kItem, line);
      e->args.push_back(std::move(obj));
      e->args.push_back(std::move(parts[0]));
      return e;
    }
    auto e = Make(ExprKind::kSlice, line);
    e->args.push_back(std::move(obj));
    for (auto& p : parts) e->args.push_back(std::move(p));
    return e;
  }

  void ParseCallArgs(Expr* e) {
    ExpectOp("(");
    bool first = true;
    while (!IsOp(")")) {
      if (!first) ExpectOp(",");
      first = false;
      if (IsOp(")")) break;
      if (IsOp("*") || IsOp("**"))
        Fail(Peek().line, "*args and **kwargs in calls are not supported");
      if (Peek().type == TokenType::kName && IsOp("=", 1)) {
        std::string key = Next().value;
        Next();
        e->kwargs.emplace_back(std::move(key), ParseExpression());
      } else {
        if (!e->kwargs.empty()) Fail(Peek().line, "positional argument after keyword argument");
        e->args.push_back(ParseExpression());
      }
    }
    ExpectOp(")");
  }

  ExprPtr ParseCall(ExprPtr callee) {
    DepthGuard guard(this);
    auto e = Make(ExprKind::kCall, Peek().line);
    e->args.push_back(std::move(callee));
    ParseCallArgs(e.get());
    return e;
  }

  void ParseFilterNameAndArgs(Expr* f) {
    f->name = ExpectName();
    while (IsOp(".")) {
      Next();
      f->name += "." + ExpectName();
    }
    if (IsOp("(")) ParseCallArgs(f);
  }

  ExprPtr ParseFilterExpr(ExprPtr e) {
    while (true) {
      if (IsOp("|")) {
        auto f = Make(ExprKind::kFilter, Next().line);
        f->args.push_back(std::move(e));
        ParseFilterNameAndArgs(f.get());
        e = std::move(f);
      } else if (IsName("is")) {
        auto t = Make(ExprKind::kTest, Next().line);
        t->negated = SkipName("not");
        t->name = ExpectName();
        while (IsOp(".")) {
          Next();
          t->name += "." + ExpectName();
        }
        t->args.push_back(std::move(e));
        const Token& a = Peek();
        if (IsOp("(")) {
          ParseCallArgs(t.get());
        } else if ((a.type == TokenType::kName || a.type == TokenType::kString ||
                    a.type == TokenType::kInteger || a.type == TokenType::kFloat || IsOp("[") ||
                    IsOp("{")) &&
                   !IsName("else") && !IsName("or") && !IsName("and")) {
          if (IsName("is")) Fail(a.line, "you cannot chain multiple tests with is");
          t->args.push_back(ParsePostfix(ParsePrimary()));
        }
        e = std::move(t);
      } else if (IsOp("(")) {
        e = ParseCall(std::move(e));
      } else {
        return e;
      }
    }
  }

  std::vector<Token> tokens_;
  size_t pos_ = 0;
  int depth_ = 0;
  int loop_depth_ = 0;
  bool has_generation_ = false;
};

}  // namespace

StmtList ParseTemplate(std::string_view source, bool* has_generation) {
  return Parser(Tokenize(source)).Run(has_generation);
}

}  // namespace strata::data::jinja
