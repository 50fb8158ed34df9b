//! Label and field selectors, parsed and applied as kube-apiserver does.
//!
//! - Label selectors follow staging/src/k8s.io/apimachinery/pkg/labels/selector.go
//!   (`Parse`): the same lexer and recursive-descent parser (`=`, `==`, `!=`, `in`,
//!   `notin`, `key`, `!key`, `>`, `<`), keys checked as qualified names and values as
//!   label values (`NewRequirement`), and the same error texts. A malformed selector is
//!   a 400 (staging/src/k8s.io/apiserver/pkg/endpoints/handlers/get.go: decoding the
//!   ListOptions fails).
//! - Field selectors follow staging/src/k8s.io/apimachinery/pkg/fields/selector.go
//!   (terms split on unescaped commas, `!=`, `==`, `=`, `\` escapes in values). Each
//!   field is converted by the kind's field-label conversion function
//!   (pkg/apis/core/v1/conversion.go `AddFieldLabelConversionFunc` for Pods, Nodes,
//!   Events, Namespaces and Secrets; pkg/apis/batch/v1/conversion.go for Jobs;
//!   `runtime.DefaultMetaV1FieldSelectorConversion`,
//!   staging/src/k8s.io/apimachinery/pkg/runtime/conversion.go, for every other kind),
//!   and a field the kind does not support is a 400 with that function's message
//!   (get.go: `opts.FieldSelector.Transform`). Values are matched against the kind's
//!   selectable fields: pkg/registry/core/pod/strategy.go `ToSelectableFields`,
//!   pkg/registry/core/node/strategy.go `NodeToSelectableFields`,
//!   pkg/registry/core/event/strategy.go `ToSelectableFields`,
//!   pkg/registry/core/namespace/strategy.go, pkg/registry/core/secret/strategy.go,
//!   pkg/registry/batch/job/strategy.go, and `generic.ObjectMetaFieldsSet` for the rest.

use serde_json::Value;

pub use crate::field_selectors::{convert_field, field_value, FieldSelector};
use crate::validation::{is_label_value, is_qualified_name};
use crate::Kind;

/// A label selector requirement's operator (staging/src/k8s.io/apimachinery/pkg/selection).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operator {
    /// `key in (a,b)`.
    In,
    /// `key notin (a,b)`.
    NotIn,
    /// `key=a`.
    Equals,
    /// `key==a`.
    DoubleEquals,
    /// `key!=a`.
    NotEquals,
    /// `key`.
    Exists,
    /// `!key`.
    DoesNotExist,
    /// `key>1`.
    GreaterThan,
    /// `key<1`.
    LessThan,
}

/// One requirement of a label selector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Requirement {
    /// The label key.
    pub key: String,
    /// The operator.
    pub operator: Operator,
    /// The values, sorted and without duplicates (`sets.String.List()`).
    pub values: Vec<String>,
}

impl Requirement {
    /// `Requirement.Matches`.
    pub fn matches(&self, labels: &Value) -> bool {
        let got = labels.get(&self.key).and_then(Value::as_str);
        let has = |v: &str| self.values.iter().any(|x| x == v);
        match self.operator {
            Operator::In | Operator::Equals | Operator::DoubleEquals => got.is_some_and(has),
            Operator::NotIn | Operator::NotEquals => !got.is_some_and(has),
            Operator::Exists => got.is_some(),
            Operator::DoesNotExist => got.is_none(),
            Operator::GreaterThan | Operator::LessThan => {
                let (Some(have), [want]) = (
                    got.and_then(|g| g.parse::<i64>().ok()),
                    self.values.as_slice(),
                ) else {
                    return false;
                };
                let Ok(want) = want.parse::<i64>() else {
                    return false;
                };
                if self.operator == Operator::GreaterThan {
                    have > want
                } else {
                    have < want
                }
            }
        }
    }
}

/// A parsed label selector: every requirement must hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelSelector {
    /// The requirements, sorted by key.
    pub requirements: Vec<Requirement>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Token {
    Error,
    End,
    ClosedPar,
    Comma,
    DoesNotExist,
    DoubleEquals,
    Equals,
    GreaterThan,
    Identifier,
    In,
    LessThan,
    NotEquals,
    NotIn,
    OpenPar,
}

fn token_of(s: &[u8]) -> Option<Token> {
    Some(match s {
        b")" => Token::ClosedPar,
        b"," => Token::Comma,
        b"!" => Token::DoesNotExist,
        b"==" => Token::DoubleEquals,
        b"=" => Token::Equals,
        b">" => Token::GreaterThan,
        b"in" => Token::In,
        b"<" => Token::LessThan,
        b"!=" => Token::NotEquals,
        b"notin" => Token::NotIn,
        b"(" => Token::OpenPar,
        _ => return None,
    })
}

fn special(c: u8) -> bool {
    matches!(c, b'=' | b'!' | b'(' | b')' | b',' | b'>' | b'<')
}

fn whitespace(c: u8) -> bool {
    matches!(c, b' ' | b'\t' | b'\r' | b'\n')
}

/// The lexer (`Lexer.Lex`): every token of `s`, the end included.
fn scan(s: &str) -> Vec<(Token, String)> {
    let b = s.as_bytes();
    let mut pos = 0;
    let mut out = Vec::new();
    loop {
        while pos < b.len() && whitespace(b[pos]) {
            pos += 1;
        }
        if pos >= b.len() {
            out.push((Token::End, String::new()));
            return out;
        }
        let start = pos;
        if special(b[pos]) {
            // scanSpecialSymbol: the longest run of special characters that is a token.
            let mut last: Option<(Token, usize)> = None;
            while pos < b.len() && special(b[pos]) {
                match token_of(&b[start..=pos]) {
                    Some(t) => last = Some((t, pos + 1)),
                    None if last.is_some() => break,
                    None => {}
                }
                pos += 1;
            }
            match last {
                Some((t, end)) => {
                    pos = end;
                    out.push((t, String::from_utf8_lossy(&b[start..end]).into_owned()));
                }
                None => out.push((
                    Token::Error,
                    format!(
                        "error expected: keyword found '{}'",
                        String::from_utf8_lossy(&b[start..pos])
                    ),
                )),
            }
        } else {
            while pos < b.len() && !special(b[pos]) && !whitespace(b[pos]) {
                pos += 1;
            }
            let lit = &b[start..pos];
            let tok = match token_of(lit) {
                Some(t @ (Token::In | Token::NotIn)) => t,
                _ => Token::Identifier,
            };
            out.push((tok, String::from_utf8_lossy(lit).into_owned()));
        }
    }
}

/// Where the parser is: `in` and `notin` are values where values are expected.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Context {
    KeyAndOperator,
    Values,
}

struct Parser {
    items: Vec<(Token, String)>,
    position: usize,
}

impl Parser {
    fn lookahead(&self, ctx: Context) -> (Token, String) {
        let (t, l) = self.items[self.position.min(self.items.len() - 1)].clone();
        (Self::in_context(t, ctx), l)
    }

    fn consume(&mut self, ctx: Context) -> (Token, String) {
        let item = self.lookahead(ctx);
        self.position += 1;
        item
    }

    fn in_context(t: Token, ctx: Context) -> Token {
        match t {
            Token::In | Token::NotIn if ctx == Context::Values => Token::Identifier,
            t => t,
        }
    }

    fn parse(&mut self) -> Result<Vec<Requirement>, String> {
        let mut reqs = Vec::new();
        loop {
            let (tok, lit) = self.lookahead(Context::Values);
            match tok {
                Token::Identifier | Token::DoesNotExist => {
                    let r = self
                        .requirement()
                        .map_err(|e| format!("unable to parse requirement: {e}"))?;
                    reqs.push(r);
                    let (t, l) = self.consume(Context::Values);
                    match t {
                        Token::End => return Ok(reqs),
                        Token::Comma => {
                            let (t2, l2) = self.lookahead(Context::Values);
                            if t2 != Token::Identifier && t2 != Token::DoesNotExist {
                                return Err(format!(
                                    "found '{l2}', expected: identifier after ','"
                                ));
                            }
                        }
                        _ => return Err(format!("found '{l}', expected: ',' or 'end of string'")),
                    }
                }
                Token::End => return Ok(reqs),
                _ => {
                    return Err(format!(
                        "found '{lit}', expected: !, identifier, or 'end of string'"
                    ))
                }
            }
        }
    }

    fn requirement(&mut self) -> Result<Requirement, String> {
        let (key, op) = self.key_and_operator()?;
        let op = match op {
            Some(op @ (Operator::Exists | Operator::DoesNotExist)) => {
                return new_requirement(key, op, Vec::new())
            }
            _ => self.operator()?,
        };
        let values = match op {
            Operator::In | Operator::NotIn => self.values()?,
            _ => self.exact_value()?,
        };
        new_requirement(key, op, values)
    }

    fn key_and_operator(&mut self) -> Result<(String, Option<Operator>), String> {
        let mut op = None;
        let (mut tok, mut lit) = self.consume(Context::Values);
        if tok == Token::DoesNotExist {
            op = Some(Operator::DoesNotExist);
            (tok, lit) = self.consume(Context::Values);
        }
        if tok != Token::Identifier {
            return Err(format!("found '{lit}', expected: identifier"));
        }
        let errs = is_qualified_name(&lit);
        if !errs.is_empty() {
            // validateLabelKey with the parser's (nil) field path.
            return Err(format!(
                "<nil>: Invalid value: {lit:?}: {}",
                errs.join("; ")
            ));
        }
        let (t, _) = self.lookahead(Context::Values);
        if matches!(t, Token::End | Token::Comma) && op.is_none() {
            op = Some(Operator::Exists);
        }
        Ok((lit, op))
    }

    fn operator(&mut self) -> Result<Operator, String> {
        let (tok, lit) = self.consume(Context::KeyAndOperator);
        Ok(match tok {
            Token::In => Operator::In,
            Token::Equals => Operator::Equals,
            Token::DoubleEquals => Operator::DoubleEquals,
            Token::GreaterThan => Operator::GreaterThan,
            Token::LessThan => Operator::LessThan,
            Token::NotIn => Operator::NotIn,
            Token::NotEquals => Operator::NotEquals,
            _ => {
                return Err(format!(
                    "found '{lit}', expected: in, notin, =, ==, !=, gt, lt"
                ))
            }
        })
    }

    fn values(&mut self) -> Result<Vec<String>, String> {
        let (tok, lit) = self.consume(Context::Values);
        if tok != Token::OpenPar {
            return Err(format!("found '{lit}' expected: '('"));
        }
        let (tok, lit) = self.lookahead(Context::Values);
        match tok {
            Token::Identifier | Token::Comma => {
                let s = self.identifiers()?;
                if self.consume(Context::Values).0 != Token::ClosedPar {
                    return Err(format!("found '{lit}', expected: ')'"));
                }
                Ok(s)
            }
            Token::ClosedPar => {
                self.consume(Context::Values);
                Ok(vec![String::new()])
            }
            _ => Err(format!("found '{lit}', expected: ',', ')' or identifier")),
        }
    }

    fn identifiers(&mut self) -> Result<Vec<String>, String> {
        let mut s: Vec<String> = Vec::new();
        loop {
            let (tok, lit) = self.consume(Context::Values);
            match tok {
                Token::Identifier => {
                    s.push(lit);
                    let (t2, l2) = self.lookahead(Context::Values);
                    match t2 {
                        Token::Comma => continue,
                        Token::ClosedPar => return Ok(s),
                        _ => return Err(format!("found '{l2}', expected: ',' or ')'")),
                    }
                }
                Token::Comma => {
                    if s.is_empty() {
                        s.push(String::new());
                    }
                    let (t2, _) = self.lookahead(Context::Values);
                    if t2 == Token::ClosedPar {
                        s.push(String::new());
                        return Ok(s);
                    }
                    if t2 == Token::Comma {
                        s.push(String::new());
                    }
                }
                _ => return Err(format!("found '{lit}', expected: ',', or identifier")),
            }
        }
    }

    fn exact_value(&mut self) -> Result<Vec<String>, String> {
        let (tok, _) = self.lookahead(Context::Values);
        if matches!(tok, Token::End | Token::Comma) {
            return Ok(vec![String::new()]);
        }
        let (tok, lit) = self.consume(Context::Values);
        if tok == Token::Identifier {
            Ok(vec![lit])
        } else {
            Err(format!("found '{lit}', expected: identifier"))
        }
    }
}

/// `NewRequirement`: the values are label values; `>` and `<` take one integer.
fn new_requirement(
    key: String,
    op: Operator,
    mut values: Vec<String>,
) -> Result<Requirement, String> {
    values.sort();
    values.dedup();
    let mut errs = Vec::new();
    if matches!(op, Operator::GreaterThan | Operator::LessThan) {
        for (i, v) in values.iter().enumerate() {
            if v.parse::<i64>().is_err() {
                errs.push(format!("values[{i}]: Invalid value: {v:?}: for 'Gt', 'Lt' operators, the value must be an integer"));
            }
        }
    }
    for (i, v) in values.iter().enumerate() {
        let e = is_label_value(v);
        if !e.is_empty() {
            errs.push(format!(
                "values[{i}][{key}]: Invalid value: {v:?}: {}",
                e.join("; ")
            ));
        }
    }
    match errs.len() {
        0 => Ok(Requirement {
            key,
            operator: op,
            values,
        }),
        1 => Err(errs.remove(0)),
        _ => Err(format!("[{}]", errs.join(", "))),
    }
}

impl LabelSelector {
    /// `labels.Parse`: the selector, or upstream's error text.
    pub fn parse(selector: &str) -> Result<Self, String> {
        let mut p = Parser {
            items: scan(selector),
            position: 0,
        };
        let mut requirements = p.parse()?;
        requirements.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(LabelSelector { requirements })
    }

    /// Whether `labels` (an object's `metadata.labels`, absent or null for none) match.
    pub fn matches(&self, labels: &Value) -> bool {
        self.requirements.iter().all(|r| r.matches(labels))
    }

    /// Whether it selects everything.
    pub fn is_empty(&self) -> bool {
        self.requirements.is_empty()
    }
}

/// A list's or a watch's label and field selectors together.
#[derive(Debug, Clone, Default)]
pub struct Selection {
    /// The label selector.
    pub labels: LabelSelector,
    /// The field selector.
    pub fields: FieldSelector,
}

impl Selection {
    /// Both selectors of a request for kind `k`, or the 400's message.
    pub fn parse(k: &Kind, labels: Option<&str>, fields: Option<&str>) -> Result<Self, String> {
        Ok(Selection {
            labels: LabelSelector::parse(labels.unwrap_or(""))?,
            fields: FieldSelector::parse(k, fields.unwrap_or(""))?,
        })
    }

    /// Whether `obj`, of kind `k`, is selected.
    pub fn matches(&self, k: &Kind, obj: &Value) -> bool {
        self.labels
            .matches(obj.pointer("/metadata/labels").unwrap_or(&Value::Null))
            && self.fields.matches(k, obj)
    }

    /// Whether it selects everything (`SelectionPredicate.Empty`).
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty() && self.fields.is_empty()
    }

    /// The node of a `spec.nodeName=N` term: what the pods' index serves
    /// (pkg/registry/core/pod/strategy.go `NodeNameTriggerFunc`/`MatchPod`'s
    /// `IndexFields`; a `!=` term is not served from it).
    pub fn node_name(&self) -> Option<&str> {
        self.fields
            .terms
            .iter()
            .find(|(f, _, negated)| f == "spec.nodeName" && !negated)
            .map(|(_, v, _)| v.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::KINDS;
    use serde_json::json;

    fn kind(plural: &str) -> &'static Kind {
        KINDS.iter().find(|k| k.plural == plural).unwrap()
    }

    #[test]
    fn set_based_label_selectors_parse_and_match_as_upstream() {
        // staging/src/k8s.io/apimachinery/pkg/labels/selector_test.go cases.
        let l = json!({"gpu": "h100", "zone": "a", "n": "5"});
        let yes = [
            "gpu in (h100,a100)",
            "gpu notin (a100)",
            "gpu",
            "!absent",
            "gpu=h100",
            "gpu==h100",
            "gpu!=a100",
            "absent notin (x)",
            "absent!=x",
            "n>4,n<6",
            "  gpu in ( h100 ) , zone = a ",
            "gpu in (in,h100)",
            "",
        ];
        for s in yes {
            assert!(LabelSelector::parse(s).unwrap().matches(&l), "{s}");
        }
        for s in [
            "gpu in (a100)",
            "gpu notin (h100)",
            "!gpu",
            "absent",
            "gpu=a100",
            "n>5",
            "absent in (x)",
            "x in (in)",
        ] {
            assert!(!LabelSelector::parse(s).unwrap().matches(&l), "{s}");
        }
        let r = LabelSelector::parse("x in (b,a,,b)").unwrap();
        assert_eq!(r.requirements[0].values, ["", "a", "b"]);
        assert_eq!(
            LabelSelector::parse("x in ()").unwrap().requirements[0].values,
            [""]
        );
        assert!(LabelSelector::parse("gpu=")
            .unwrap()
            .matches(&json!({"gpu": ""})));
    }

    #[test]
    fn malformed_label_selectors_fail_with_upstreams_words() {
        for (s, want) in [
            ("x in", "unable to parse requirement: found '' expected: '('"),
            ("x in (a", "unable to parse requirement: found '', expected: ',' or ')'"),
            ("x=a,", "found '', expected: identifier after ','"),
            ("x=a b", "found 'b', expected: ',' or 'end of string'"),
            ("=a", "found '=', expected: !, identifier, or 'end of string'"),
            ("x (a)", "unable to parse requirement: found '(', expected: in, notin, =, ==, !=, gt, lt"),
            ("x>a", "unable to parse requirement: values[0]: Invalid value: \"a\": for 'Gt', 'Lt' operators, the value must be an integer"),
            ("!x=a", "found '=', expected: ',' or 'end of string'"),
        ] {
            assert_eq!(LabelSelector::parse(s).unwrap_err(), want, "{s}");
        }
        let bad_key = LabelSelector::parse("a b c=d").unwrap_err();
        assert_eq!(
            bad_key,
            "unable to parse requirement: found 'b', expected: in, notin, =, ==, !=, gt, lt"
        );
        assert!(LabelSelector::parse("-x=a").unwrap_err().starts_with(
            "unable to parse requirement: <nil>: Invalid value: \"-x\": name part must consist"
        ));
        assert!(LabelSelector::parse("x=-a")
            .unwrap_err()
            .contains("values[0][x]: Invalid value: \"-a\""));
    }

    #[test]
    fn field_selectors_follow_each_kinds_conversion() {
        let pods = kind("pods");
        let pod = json!({"kind": "Pod", "metadata": {"name": "p", "namespace": "ns"},
            "spec": {"nodeName": "n1"}, "status": {"phase": "Running", "podIPs": [{"ip": "10.0.0.1"}]}});
        for (s, m) in [
            ("spec.nodeName=n1", true),
            ("spec.host=n1", true),
            ("spec.nodeName==n1,status.phase!=Succeeded", true),
            ("status.podIP=10.0.0.1", true),
            ("spec.hostNetwork=false", true),
            ("status.podIPs=10.0.0.1", false),
            ("metadata.namespace=ns,metadata.name=p", true),
            ("spec.nodeName=n2", false),
            ("spec.nodeName=", false),
        ] {
            assert_eq!(
                FieldSelector::parse(pods, s).unwrap().matches(pods, &pod),
                m,
                "{s}"
            );
        }
        assert_eq!(
            FieldSelector::parse(pods, "spec.containers=x").unwrap_err(),
            "field label not supported: spec.containers"
        );
        assert_eq!(
            FieldSelector::parse(kind("configmaps"), "data.x=y").unwrap_err(),
            "\"data.x\" is not a known field selector: only \"metadata.name\", \"metadata.namespace\""
        );
        let nodes = kind("nodes");
        assert_eq!(
            FieldSelector::parse(nodes, "metadata.namespace=x").unwrap_err(),
            "field label not supported: metadata.namespace"
        );
        let node = json!({"metadata": {"name": "n"}, "spec": {"unschedulable": true}});
        assert!(FieldSelector::parse(nodes, "spec.unschedulable=true")
            .unwrap()
            .matches(nodes, &node));
        let events = kind("events");
        let ev = json!({"metadata": {"name": "e", "namespace": "default"}, "involvedObject": {"kind": "Node", "name": "n"}, "reason": "R", "reportingComponent": "faultline"});
        assert!(
            FieldSelector::parse(events, "involvedObject.kind=Node,reason=R,source=faultline")
                .unwrap()
                .matches(events, &ev)
        );
        assert!(FieldSelector::parse(kind("leases"), "metadata.name=x").is_ok());
        assert!(FieldSelector::parse(kind("secrets"), "type=Opaque").is_ok());
        assert!(FieldSelector::parse(kind("jobs"), "status.successful=1").is_ok());
    }

    #[test]
    fn field_selector_syntax_as_upstream() {
        let cms = kind("configmaps");
        assert_eq!(
            FieldSelector::parse(cms, "metadata.name").unwrap_err(),
            "invalid selector: 'metadata.name'; can't understand 'metadata.name'"
        );
        assert_eq!(
            FieldSelector::parse(cms, "metadata.name=a=b").unwrap_err(),
            "invalid field selector: unescaped character in value: 61"
        );
        assert_eq!(
            FieldSelector::parse(cms, "metadata.name=a\\x").unwrap_err(),
            "invalid field selector: invalid escape sequence: \\x"
        );
        let s = FieldSelector::parse(cms, "metadata.name=a\\,b").unwrap();
        assert_eq!(
            s.terms,
            [("metadata.name".to_string(), "a,b".to_string(), false)]
        );
        // No trimming: a space belongs to the field's name.
        assert!(FieldSelector::parse(cms, "metadata.name = a").is_err());
        assert!(FieldSelector::parse(cms, ",,").unwrap().is_empty());
    }
}
